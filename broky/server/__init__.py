"""The Broky server: a master process that accepts connections and hands each to a
worker process, whose shard owns its vbuckets, connections and subscriptions.

One package per process, one module per concern (docs/contributing/layout.md
draws it; tests/repo/test_architecture.py holds the rules):

  master/    the master process: accept, Hello, auth, hand-off, HTTP, and the
             supervisor that starts, reaps and restarts the workers; the
             `serve` and `passwd` subcommands
  worker/    a worker process: the event loop around its shard, the views it
             answers the master's STATS requests with, the loop probe
  shard/     the shard inside a worker: a core, the fan-out fast path and its
             compiled twin, and its parts (connections' arrivals, groups,
             positions: the replay buffer, starts and reads; moves, the
             restart grace, budgets, counters), which know the core through
             one Protocol and never each other
  http/      the HTTP port, served by the master: the server, the monitoring
             endpoints and metrics, the console, the gateway (/v1/)
  security/  users and their permissions, TLS

and, shared by both processes: config (flags and BROKY_* environment), logs,
accounts (the per-connection accounts a worker keeps and the master reads
after its death), handoff (the master <-> worker channel: SCM_RIGHTS and
control messages) and histogram (the latency histograms).

Who may import whom: master -> http, security, shard.fastpath and the shared
modules; worker -> shard, security and the shared modules, never http; shard
-> security and the shared modules; http -> security, shard.stats (the
counters' names) and the shared modules; security -> the shared modules.
"""

# The numpy placeholder that keeps flatbuffers from loading numpy in the
# server's processes is set by the package itself (broky/__init__.py).
