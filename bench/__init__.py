"""Broky's benchmarks: the pub/sub harness (`python -m bench`) and micro-benchmarks."""
