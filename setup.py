"""Build of the compiled parts: the twins of the fan-out fast path (server), of
the SDK's publish encoding (client) and of the Spark source's column decoding.

Everything else is in pyproject.toml. The extensions are optional: without a
C compiler the install still succeeds and the pure-Python reference runs (the
server says so when it starts, see broky/server/shard/fastpath.py; the client in
broky.client.pubpack.description; the Spark source in
broky.spark.readcols.description). All read the canonical Message layout's
positions from broky.protocol.layout when they are configured at import
(broky/protocol/_layout.h).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "broky.server.shard._feedscan",
            ["broky/server/shard/_feedscan.c"],
            depends=["broky/protocol/_layout.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "broky.client._pubpack",
            ["broky/client/_pubpack.c"],
            depends=["broky/protocol/_layout.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "broky.spark._readcols",
            ["broky/spark/_readcols.c"],
            depends=["broky/protocol/_layout.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
