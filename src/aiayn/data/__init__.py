"""Data (section 5.1): download the corpus, learn the subword vocabulary, encode it into
tensors, and cut it into token-bucketed batches."""
