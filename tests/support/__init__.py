"""What the tests share, and only that: no test module imports another test module.

Real processes (serverproc: `broky serve`; cluster: etcd and cluster nodes; browser:
headless Chromium; spark_fixtures: one local Spark session; faultproxy: a TCP proxy that
cuts and stalls), the wire and the HTTP port as the tests speak them (wire, http), the
shard with in-memory transports (shardkit), the SDK's and the CLI's helpers (sdk, cli),
the protocol's strategies and reference reader/writer (generated, mutations), TLS
certificates (tls), the programs a test needs (requires) and where the repository is
(paths). tests/repo/test_tests_layout.py holds the rule.
"""
