"""The control channel between the master and one worker, and the socket hand-off.

Each worker has one AF_UNIX SOCK_SEQPACKET socketpair with the master. Every
datagram is one explicit message: a one-byte kind, then its payload. Messages
keep their boundaries, so no framing is needed, and a client socket travels
with its message as SCM_RIGHTS ancillary data (`socket.send_fds`).

master -> worker
    CONFIG   JSON boot settings (the first message; the worker boots from it):
             {"config": ServerConfig, "epoch": the worker's connection id epoch,
             "grace": restart grace seconds (0: none), "expect": number of EXPECT
             messages that follow}
    EXPECT   uint64 connection ids (follows CONFIG when the worker replaces a
             dead one): the dead worker's connections that had subscriptions
             (broky.server.fanout `Shard.start_grace`)
    CONN     uint8 length of an account + that account (broky.server.accounts
             `Account.pack`, for a client resuming a dead worker's connection)
             + the bytes already read from the client (its Hello frame), with
             the client socket's fd attached
    STATS    uint32 request id + what: ask for a stats snapshot (what = b""),
             or another view (broky.server.monitor.answer)
worker -> master
    READY    the worker serves (sent once after boot)
    STATS    uint32 request id + JSON snapshot
    LOAD     uint32 number of open connections + uint64 number of connections
             received (CONN) since the worker started; sent when either
             changes, and at least every 0.5 s: the master's heartbeat for
             /readyz. The master subtracts the second from the connections it
             handed to that worker to know how many are still in the channel.

After a CONN the master closes its own copy of the socket; the worker owns it.
A worker that reads EOF on the channel knows the master is gone and exits.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

CONFIG = b"K"
EXPECT = b"E"
CONN = b"C"
STATS = b"S"
READY = b"R"
LOAD = b"L"

MAX_MESSAGE = 1 << 20  # larger than any Hello or stats snapshot
_u32 = struct.Struct("<I")
_load = struct.Struct("<IQ")


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(master end, worker end) of a new control channel."""
    master, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (master, worker):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE + 4096)
    return master, worker


def send(chan: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    """Send one message; a datagram goes whole or raises (BlockingIOError when full)."""
    chan.send(kind + payload)


def send_socket(
    chan: socket.socket, client: socket.socket, already_read: bytes, account: bytes = b""
) -> None:
    """Hand a client socket, the bytes read from it so far and its account to the worker."""
    socket.send_fds(chan, [CONN + bytes((len(account),)) + account + already_read], [client.fileno()])


def split_conn(payload: bytes) -> tuple[bytes, bytes]:
    """(account, bytes already read) of a CONN payload."""
    n = payload[0]
    return payload[1 : 1 + n], payload[1 + n :]


EXPECT_BATCH = 65536  # ids per EXPECT message (512 KiB)


def pack_ids(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}Q", *ids)


def split_ids(payload: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(payload) // 8}Q", payload))


def send_json(chan: socket.socket, kind: bytes, request_id: int, data: Any) -> None:
    send(chan, kind, _u32.pack(request_id) + json.dumps(data).encode())


def recv(chan: socket.socket) -> tuple[bytes, bytes, int | None]:
    """Receive one message: (kind, payload, fd or None); kind b"" at EOF.

    Raises:
        BlockingIOError: nothing to read on a non-blocking channel.
    """
    data, fds, _flags, _addr = socket.recv_fds(chan, MAX_MESSAGE, 1)
    fd = fds[0] if fds else None
    if not data:
        if fd is not None:
            socket.close(fd)
        return b"", b"", None
    return data[:1], data[1:], fd


def split_id(payload: bytes) -> tuple[int, bytes]:
    """(request id, rest) of a STATS or LOAD payload."""
    return _u32.unpack_from(payload)[0], payload[4:]


def pack_id(value: int) -> bytes:
    return _u32.pack(value)


def pack_load(open_connections: int, adopted: int) -> bytes:
    """The payload of a LOAD message."""
    return _load.pack(open_connections, adopted)


def split_load(payload: bytes) -> tuple[int, int]:
    """(open connections, connections received since boot) of a LOAD payload."""
    open_connections, adopted = _load.unpack_from(payload)
    return open_connections, adopted
