"""Start and stop real `broky serve` processes for the tests.

The server prints one ready line on stdout once every worker is up, e.g.
``broky ready: listening on 127.0.0.1:41234, metrics on 127.0.0.1:41235, workers 2, pid 1234``;
`ServerProcess.start` waits for it and reads the bound ports from it
(the tests always pass --port 0 and --metrics-port 0). Every process is
stopped by its pid (and its process group, for the workers) at the end.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.http import http_get

READY = re.compile(rb"listening on (\S+):(\d+), metrics on (\S+):(\d+)")


class ServerProcess:
    def __init__(
        self,
        *args: str,
        workers: int = 2,
        env: dict[str, str] | None = None,
        program: list[str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """`program`: the `broky` to run (default: this Python's `-m broky`); `cwd`: where."""
        self.args = [
            *(program or [sys.executable, "-m", "broky"]), "serve",
            "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--workers", str(workers), *args,
        ]  # fmt: skip
        self.workers = workers
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.metrics_port = 0
        self.ready_line = b""
        self._log = tempfile.NamedTemporaryFile(prefix="broky-serve-", suffix=".log", delete=False)  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"broky://{self.host}:{self.port}"

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        pending = b""
        while (left := deadline - time.monotonic()) > 0:
            if not poller.poll(left * 1000):
                break  # timed out
            chunk = os.read(fd, 4096)  # never blocks after poll said readable
            if not chunk:
                break  # the server exited
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                match = READY.search(line)
                if match:
                    self.ready_line = line + b"\n"
                    self.host = match.group(1).decode()
                    self.port = int(match.group(2))
                    self.metrics_port = int(match.group(4))
                    return self
        self.stop()
        raise RuntimeError(f"broky serve did not become ready within {timeout:g} s; log:\n{self.log()}")

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 10.0) -> str:
        """The log once it holds `text` (a line another process may see the effect of
        before this one has written it); AssertionError with the log after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.log()
            if text in log or time.monotonic() > deadline:
                assert text in log, f"{text!r} not logged within {timeout:g} s; log:\n{log}"
                return log
            time.sleep(0.05)

    def worker_pids(self) -> list[int]:
        """Pids of the master's live child processes (the workers)."""
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        try:
            return [int(p) for p in children.read_text().split()]
        except OSError:
            return []

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:  # workers share the master's process group; none may outlive the test
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        os.unlink(self._log.name)
        self.proc = None


def wait_restarted(server: ServerProcess, old: list[int], timeout: float = 10.0) -> None:
    """Until every worker is ready again and the killed one has a new pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = server.worker_pids()
        if len(pids) == server.workers and pids != old:
            status, _ = http_get(server, "/readyz")
            if status == 200:
                return
        time.sleep(0.02)
    raise AssertionError(f"worker not restarted in {timeout} s:\n{server.log()}")


def kill_worker(server: ServerProcess, worker: int) -> None:
    """SIGKILL one worker (its pid from /stats) and wait for its successor."""
    old = server.worker_pids()
    _, body = http_get(server, "/stats")
    pid = json.loads(body)["workers"][worker]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_restarted(server, old)
