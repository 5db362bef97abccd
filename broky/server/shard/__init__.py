"""The shard inside a worker: its vbuckets, connections, subscriptions and the fan-out fast path.

See broky.server, and broky.server.shard.core for its parts.
"""
