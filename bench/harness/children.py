"""The client processes a benchmark starts: what they report, and stopping them.

Each client process (bench.worker_kill's, bench.sdk_burst's) prints one JSON
object as its last line; a run kills, by pid, whichever of its processes is
still running when it ends, however it ends.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from typing import Any


def last_json(output: str) -> dict[str, Any]:
    """The JSON object on the last line of a client process's output."""
    result: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return result


def kill_all(procs: Iterable[subprocess.Popen[str]]) -> None:
    """SIGKILL every process of `procs` still running, and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)
