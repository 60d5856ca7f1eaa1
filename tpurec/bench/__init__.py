"""Benchmarks: scripts that print JSON with a ratio against a peer measured in the same run."""
