"""Benchmarks: every mode on the same requests in one process, interleaved; paired ratios."""
