"""Users, their permissions, and TLS (see broky.server)."""
