"""The shard inside a worker: its vbuckets, connections, subscriptions and the fan-out fast path.

A core and parts: broky.server.shard.core is the write path in one class and
lists the parts; broky.server.shard.part says how they meet. See broky.server
for the packages around it.
"""
