"""Benchmarks: one module per study (memory, speed, gmm), each printing a table and
writing JSON and a PNG plot under bench/results/. Run as `python -m bench.<study>`."""
