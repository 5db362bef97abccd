"""A worker process: the event loop around its shard (see broky.server)."""
