"""The pub/sub benchmark harness behind `python -m bench`, one module per concern.

machine   what the results ran on (CPU, cores, memory, Python, server versions)
servers   start/stop broky serve, nats-server and redis-server on loopback ports
procstat  server CPU seconds and peak RSS from /proc
loadgen   the load generator: raw sockets, pre-encoded publishes, counting subscribers
latency   open-loop latency runs recorded in HdrHistograms
report    Markdown table with ratios, JSON and PNG plots
"""
