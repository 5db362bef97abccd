"""The Broky server: a master process that accepts and hands sockets to worker shards.

Modules, one concern each: config (flags and BROKY_* environment), cli (the
`serve` subcommand), master (accept, Hello, auth, hand-off, HTTP), handoff
(SCM_RIGHTS over the control channel), supervisor (start, reap, restart
workers), worker (one shard's process), connection (the asyncio Protocol
adapter) and fanout (the shard: the hot path, and the Shard assembled from
its other parts, each in a module of its own that fanout's header lists).
"""

# The numpy placeholder that keeps flatbuffers from loading numpy in the
# server's processes is set by the package itself (broky/__init__.py).
