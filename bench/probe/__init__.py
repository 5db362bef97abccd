"""The compiled latency probe (probe.c): built on demand, run once per latency run.

`binary()` compiles probe.c with the machine's C compiler (`cc -O2 -pthread`) into
a cache directory outside the tree (``$XDG_CACHE_HOME/broky-bench``, else
``~/.cache/broky-bench``), named by the source's hash: a changed source is built
anew, an unchanged one never. `run()` starts it with the connected sockets it is
handed (inherited file descriptors), waits for its one JSON line and returns it
with the histogram loaded into an `hdrh` HdrHistogram. probe.c's header says what
the program does; bench/harness/latency.py sets up the connections.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

SOURCE = Path(__file__).resolve().with_name("probe.c")
LOWEST_NS, HIGHEST_NS, DIGITS = 1, 60_000_000_000, 3  # as probe.c's histogram


class ProbeError(RuntimeError):
    """The probe could not be built or did not finish."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "broky-bench"


def binary() -> Path:
    """The probe's executable, compiled first if this source has not been yet."""
    source = SOURCE.read_bytes()
    target = cache_dir() / f"probe-{hashlib.sha256(source).hexdigest()[:16]}"
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ProbeError("no C compiler (cc) to build bench/probe/probe.c")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".probe-")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, "-O2", "-pthread", "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise ProbeError(f"building probe.c failed:\n{proc.stderr[-3000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders end with the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def histogram(buckets: list[list[int]]) -> HdrHistogram:
    """An hdrh HdrHistogram holding the probe's [value, count] buckets (same layout)."""
    hist = HdrHistogram(LOWEST_NS, HIGHEST_NS, DIGITS)
    for value, count in buckets:
        hist.record_value(value, count)
    return hist


def run(args: list[str], pass_fds: tuple[int, ...] = (), timeout: float = 60.0) -> dict[str, Any]:
    """Run the probe with `args` (see probe.c's usage); its JSON line, with "histogram"
    (the buckets loaded into an hdrh HdrHistogram) added."""
    proc = subprocess.run(
        [str(binary()), *args],
        pass_fds=pass_fds,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise ProbeError(f"probe exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    out["histogram"] = histogram(out["buckets"])
    return out
