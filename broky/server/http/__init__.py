"""The HTTP port, served by the master: server, monitoring, metrics, console, gateway (broky.server)."""
