"""The Broky server: a master process that accepts and hands sockets to worker shards.

Modules, one concern each: config (flags and BROKY_* environment), cli (the
`serve` subcommand), master (accept, Hello, auth, hand-off, HTTP), handoff
(SCM_RIGHTS over the control channel), supervisor (start, reap, restart
workers), worker (one shard's process), connection (the asyncio Protocol
adapter) and fanout (the hot path and the subscription table).
"""

import sys
import types

# The flatbuffers runtime and the code flatc generates (the control frames' encoders)
# import numpy whenever it is installed, as it is beside pyspark and pyarrow, for
# helpers the server never calls (the `...AsNumpy` accessors): 15 MB of resident
# memory in each server process. A server process that has not loaded numpy yet
# lets them import a placeholder instead; numpy itself stays importable (the
# placeholder is gone once they are loaded).
if "flatbuffers" not in sys.modules and "numpy" not in sys.modules:
    _placeholder = types.ModuleType("numpy", "stands in for numpy while flatbuffers is imported")
    sys.modules["numpy"] = _placeholder
    try:
        import broky.fbs  # noqa: F401  (and flatbuffers)
    finally:
        if sys.modules.get("numpy") is _placeholder:
            del sys.modules["numpy"]
    del _placeholder
