"""The master process: accept, Hello, auth, hand-off, HTTP; the workers' supervisor (broky.server)."""
