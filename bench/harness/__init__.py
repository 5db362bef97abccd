"""The benchmark harness: one module per concern, shared by every `python -m bench.*` program.

options   the command line: one parent parser with the shared options, the command a report quotes
servers   start/stop broky serve, nats-server and the Redis peer on loopback ports, each in its own directory
peers     which nats-server and Redis-protocol server run, by path
roles     a program's client processes: started, talked to, timed and killed by pid
procstat  CPU time, memory, faults and context switches from /proc; RSS and CPU samplers
machine   what the results ran on (CPU, cores, memory, Python, server and package versions)
report    headings, Markdown tables and result files (NAME.md, NAME.json); python -m bench's report
loadgen   the load generator: raw sockets, pre-encoded publishes, counting subscribers
latency   open-loop latency runs recorded in HdrHistograms
cluster   etcd and cluster nodes
tlsclient raw connections: a frame off a socket, the TLS upgrade
"""
