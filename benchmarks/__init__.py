"""Benchmark tools: network profiles, the emulated cluster, sweeps and plots."""
