"""Benchmarks of orchestrate itself and of its kernels (see BENCHMARKS.md for the commands)."""
