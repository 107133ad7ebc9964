"""Experiments built from the stages: the one-command recipes, benchmarks and curves."""
