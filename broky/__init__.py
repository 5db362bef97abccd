"""Broky: an in-memory, low-latency publish/subscribe server and its client."""

__version__ = "0.1.0"
