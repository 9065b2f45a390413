"""Benchmarks: decode/prefill speed and memory per backend, beside the machine's limits."""
