"""Inference (section 6.1): beam search with a length penalty over an incrementally decoded
model, ensembles, and translating files."""
