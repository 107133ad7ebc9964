"""Scoring model outputs against references: BLEU for translation."""
