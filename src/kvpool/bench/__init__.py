"""Benchmarks that build result records; the CLI (``kvpool bench``) prints them."""
