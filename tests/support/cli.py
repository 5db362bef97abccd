"""`broky` as a subprocess: `broky_cli` runs one command to its end, `SubProcess` keeps a
`broky sub` running in the background (started once it says it is subscribed, killed by pid).
"""

from __future__ import annotations

import os
import subprocess
import sys

BROKY = [sys.executable, "-m", "broky"]


def broky_cli(
    *args: str | bytes, stdin: bytes | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKY_")}
    return subprocess.run(
        [*BROKY, *args], input=stdin, capture_output=True, timeout=timeout, env=env, check=False
    )


class SubProcess:
    """A `broky sub` running in the background; started once it is subscribed."""

    def __init__(self, *args: str | bytes) -> None:
        self.proc = subprocess.Popen(
            [*BROKY, "sub", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        assert b"subscribed to" in line, line + self.proc.stderr.read()

    def finish(self, timeout: float = 30) -> tuple[int, bytes, bytes]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        for pipe in (self.proc.stdout, self.proc.stderr):  # still open if it was never finished
            if pipe is not None:
                pipe.close()
