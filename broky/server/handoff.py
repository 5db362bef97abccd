"""The control channel between the master and one worker, and the socket hand-off.

Each worker has one AF_UNIX SOCK_SEQPACKET socketpair with the master. Every
datagram is one explicit message: a one-byte kind, then its payload. Messages
keep their boundaries, so no framing is needed, and a client socket travels
with its message as SCM_RIGHTS ancillary data (`socket.send_fds`).

master -> worker
    CONFIG   JSON boot settings (the first message; the worker boots from it):
             {"config": ServerConfig, "epoch": the worker's connection id epoch,
             "map": the current vbucket map (JSON, or null for the single-node map),
             "grace": restart grace seconds (0: none), "expect": number of EXPECT
             messages that follow, "users": the users file (--users) as read, or null}
    MAP      JSON vbucket map (broky.protocol.VBucketMap.to_json): a newer map
             to apply (the cluster's; broky.server.shard.core `Shard.apply_map`)
    EXPECT   uint64 connection ids (follows CONFIG when the worker replaces a
             dead one): the dead worker's connections that had subscriptions
             (broky.server.shard.grace `Grace.start`)
    CONN     a hand-off: `pack_conn` (uint32 hand-off id, then the bytes already
             read from the client: its Hello frame, and for a client resuming
             a connection of a dead worker, that connection's account:
             broky.server.accounts `Account.pack`, with its secret when the
             client asked for TLS (its worker checks the claim, the master
             cannot: the secret is inside TLS); then flags: TLS_FLAG when the
             Hello asked for TLS, so the worker runs the TLS handshake and
             reads the real Hello inside it, broky.server.security.tls), with the client
             socket's fd attached
    STATS    uint32 request id + what: ask for a stats snapshot (what = b""),
             or another view (broky.server.worker.views.answer)
    GRACE    uint32 milliseconds: this server (or node) restarted, as a
             reconnecting client just showed: hold publishes that long so
             that the previous process's subscribers can subscribe again
             (broky.server.shard.grace `Grace.start_node`)
    SEQUENCES  a handover record read from etcd (JSON, broky.server.shard.moves
             `Handed`): the sequences a worker of the cluster handed over;
             the new owners continue them (`Moves.take_handed`)
    RELOAD   (no payload) SIGHUP: load the TLS certificates again; handshakes
             that start later use them (broky.server.security.tls `Certificates`)
    USERS    JSON: the users file, read again at SIGHUP (broky.server.security.users): the worker
             applies its rules at once (`Shard.apply_users`); CONFIG carries it at boot
worker -> master
    READY    the worker serves (sent once after boot)
    ADOPTED  uint32 hand-off id + uint32 open connections (this one included):
             the worker owns the socket now; sent before it reads or writes a
             byte of it, so an unanswered hand-off left the socket untouched
    REFUSED  uint32 hand-off id + cause (ASCII): the worker could not adopt the
             socket; cause is "no_fd" (the CONN arrived without its fd: the
             kernel drops it, and sets MSG_CTRUNC, when the worker is out of
             file descriptors) or the errno name of the failure (e.g. EMFILE)
    STATS    uint32 request id + JSON snapshot
    LOAD     uint32 number of open connections; sent when it differs from the
             last number the worker reported (in LOAD, ADOPTED or CLOSED), and at
             least every 0.5 s: the master's heartbeat for /readyz
    CLOSED   uint32 hand-off id + uint32 open connections: a connection the
             worker adopted (that hand-off's) is gone; the master counts open
             connections per client address with it (--max-connections-per-address)
    HANDED   a handover record (JSON, `Handed`): the sequences of the vbuckets
             this worker stopped accepting when it applied a map; the cluster
             agent writes it to etcd for their new owners (broky.cluster.node)

Every CONN is answered by exactly one ADOPTED or REFUSED with its id, and
every adopted one is followed by one CLOSED when its connection is gone (a
worker that dies sends none: the master drops what it counted for it). The
master keeps its own copy of the client socket until then, so a refused
hand-off can still be answered on the wire (SERVER_BUSY) instead of being
dropped without a word. The master's view of a worker's load is exact: the
open connections it last reported plus the hand-offs sent to it and not
answered yet (broky.server.master.process).

CONN's payload is a fixed header (hand-off id, number of fields) followed by
the length of each field, then the fields: the Hello bytes are field 0, the
account field 1 (empty: none), the flags field 2 (empty: none). New
fields are appended; `split_conn` reads the fields it knows, so a reader
ignores fields newer than itself and gets b"" for fields its peer did not send.
A worker that reads EOF on the channel knows the master is gone and exits.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, NamedTuple

CONFIG = b"K"
EXPECT = b"E"
MAP = b"M"
CONN = b"C"
STATS = b"S"
# A STATS view's list (connections, topics): its length by default, and at most.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
GRACE = b"G"
SEQUENCES = b"Q"
HANDED = b"H"
RELOAD = b"T"
USERS = b"U"
READY = b"R"
LOAD = b"L"
ADOPTED = b"A"
REFUSED = b"F"
CLOSED = b"X"

NO_FD = "no_fd"  # the REFUSED cause of a CONN that arrived without its file descriptor
TLS_FLAG = b"T"  # CONN flags: the client asked for TLS (its Hello inside TLS follows)

MAX_MESSAGE = 1 << 20  # larger than any Hello or stats snapshot
_u32 = struct.Struct("<I")
_adopted = struct.Struct("<II")
_conn_head = struct.Struct("<IH")  # hand-off id, number of fields (each then has a uint32 length)


class Received(NamedTuple):
    """One message off the channel: kind (b"" at EOF), payload, the fd it carried
    (or None), and whether the kernel dropped ancillary data (MSG_CTRUNC)."""

    kind: bytes
    payload: bytes
    fd: int | None
    truncated: bool


class Conn(NamedTuple):
    """The payload of a CONN message."""

    handoff_id: int
    hello: bytes
    account: bytes = b""  # broky.server.accounts Account.pack, or b"": none
    tls: bool = False  # the Hello asked for TLS: the worker runs the handshake (broky.server.security.tls)


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(master end, worker end) of a new control channel."""
    master, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (master, worker):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE + 4096)
    return master, worker


def pack_u32(value: int) -> bytes:
    return _u32.pack(value)


def split_u32(payload: bytes) -> int:
    return int(_u32.unpack_from(payload)[0])


def send(chan: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    """Send one message; a datagram goes whole or raises (BlockingIOError when full)."""
    chan.send(kind + payload)


def send_socket(
    chan: socket.socket,
    client: socket.socket,
    handoff_id: int,
    already_read: bytes,
    account: bytes = b"",
    tls: bool = False,
) -> None:
    """Hand a client socket, the bytes read from it so far (and the account of the
    connection it resumes; whether it asked for TLS) to the worker (CONN)."""
    socket.send_fds(chan, [CONN + pack_conn(handoff_id, already_read, account, tls)], [client.fileno()])


def send_json(chan: socket.socket, kind: bytes, request_id: int, data: Any) -> None:
    send(chan, kind, _u32.pack(request_id) + json.dumps(data).encode())


def recv(chan: socket.socket) -> Received:
    """Receive one message; kind b"" at EOF.

    Raises:
        BlockingIOError: nothing to read on a non-blocking channel.
    """
    data, fds, flags, _addr = socket.recv_fds(chan, MAX_MESSAGE, 1)
    fd = fds[0] if fds else None
    for extra in fds[1:]:  # never sent; closed rather than leaked
        socket.close(extra)
    if not data:
        if fd is not None:
            socket.close(fd)
        return Received(b"", b"", None, False)
    return Received(data[:1], data[1:], fd, bool(flags & socket.MSG_CTRUNC))


def pack_conn(handoff_id: int, hello: bytes, account: bytes = b"", tls: bool = False) -> bytes:
    """The payload of a CONN message."""
    fields: tuple[bytes, ...] = (
        (hello, account, TLS_FLAG) if tls else (hello, account) if account else (hello,)
    )
    lengths = b"".join(_u32.pack(len(f)) for f in fields)
    return _conn_head.pack(handoff_id, len(fields)) + lengths + b"".join(fields)


def split_conn(payload: bytes) -> Conn:
    """The fields of a CONN payload (fields this reader does not know are ignored)."""
    handoff_id, count = _conn_head.unpack_from(payload)
    offset = _conn_head.size + 4 * count
    fields: list[bytes] = []
    for i in range(count):
        size = _u32.unpack_from(payload, _conn_head.size + 4 * i)[0]
        fields.append(payload[offset : offset + size])
        offset += size
    hello = fields[0] if fields else b""
    account = fields[1] if len(fields) > 1 else b""
    tls = len(fields) > 2 and TLS_FLAG in fields[2]
    return Conn(handoff_id, hello, account, tls)


EXPECT_BATCH = 65536  # ids per EXPECT message (512 KiB)


def pack_ids(ids: list[int]) -> bytes:
    """The payload of an EXPECT message."""
    return struct.pack(f"<{len(ids)}Q", *ids)


def split_ids(payload: bytes) -> list[int]:
    """The connection ids of an EXPECT payload."""
    return list(struct.unpack(f"<{len(payload) // 8}Q", payload))


def split_id(payload: bytes) -> tuple[int, bytes]:
    """(request or hand-off id, rest) of a STATS or REFUSED payload."""
    return _u32.unpack_from(payload)[0], payload[4:]


def pack_id(value: int) -> bytes:
    return _u32.pack(value)


def pack_adopted(handoff_id: int, open_connections: int) -> bytes:
    """The payload of an ADOPTED message."""
    return _adopted.pack(handoff_id, open_connections)


def split_adopted(payload: bytes) -> tuple[int, int]:
    """(hand-off id, open connections) of an ADOPTED payload."""
    handoff_id, open_connections = _adopted.unpack_from(payload)
    return handoff_id, open_connections


def pack_closed(handoff_id: int, open_connections: int) -> bytes:
    """The payload of a CLOSED message."""
    return _adopted.pack(handoff_id, open_connections)


def split_closed(payload: bytes) -> tuple[int, int]:
    """(hand-off id, open connections) of a CLOSED payload."""
    handoff_id, open_connections = _adopted.unpack_from(payload)
    return handoff_id, open_connections


def pack_refused(handoff_id: int, cause: str) -> bytes:
    """The payload of a REFUSED message."""
    return _u32.pack(handoff_id) + cause.encode("ascii", "replace")


def split_refused(payload: bytes) -> tuple[int, str]:
    """(hand-off id, cause) of a REFUSED payload."""
    handoff_id, cause = split_id(payload)
    return handoff_id, cause.decode("ascii", "replace")


def pack_load(open_connections: int) -> bytes:
    """The payload of a LOAD message."""
    return _u32.pack(open_connections)


def split_load(payload: bytes) -> int:
    """The open connections of a LOAD payload."""
    open_connections: int = _u32.unpack_from(payload)[0]
    return open_connections
