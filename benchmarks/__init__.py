"""Reproducible benchmarks that report ratios to this machine's own ceilings (import from the repo root)."""
