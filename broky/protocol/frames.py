"""Control frames: values, encoders (flatbuffers.Builder) and decoders.

Control frames are rare (handshake, subscriptions, flow control, errors), so
they are built with the generated Builder helpers; they are read with the
bounds-checked reader in broky.protocol.table. Message frames, the hot ones,
live in broky.protocol.message. `decode_frame` reads any frame.

Every encoder raises LocalProtocolError for a value the schema cannot carry
(a number outside its field's range, a str where bytes are expected, ...),
never the Builder's own TypeError or struct.error.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, TypeVar

import flatbuffers

from broky import fbs
from broky.errors import ErrorCode, LocalProtocolError, MalformedFrameError, UnknownFrameError
from broky.fbs import Body
from broky.protocol.layout import FILE_IDENTIFIER, struct_at
from broky.protocol.message import (
    BODY_LAST,
    BODY_MESSAGE,
    Message,
    _canonical,
    decode_message,
)
from broky.protocol.routing import NO_OWNER, VBUCKETS, NodeInfo, VBucketMap
from broky.protocol.table import Buffer, Table, malformed, out_of_buffer, root

PROTOCOL_VERSION = 3  # schema/README.md, section 11: what changed in versions 2 and 3
# Versions a server serves. A connection speaks the one its Hello named: on a version-2
# connection the frames version 3 added are unknown (VERSION_3_FRAMES) and a Subscribe's
# group is refused (GROUPS_VERSION).
SERVED_VERSIONS = frozenset((2, 3))
GROUPS_VERSION = 3  # the version that added groups and acknowledgements (section 5.3, 5.4)
ANY_WORKER = -1
RESUME_TOKEN_BYTES = 16  # Welcome.resume_token, as the server issues it

_u32 = struct.Struct("<I").unpack_from
_u64_into = struct.Struct("<Q").pack_into


class LossReason:
    """Values of the LossReason enum of the LossNotice frame."""

    UNKNOWN = fbs.LossReason.UNKNOWN
    SLOW_CONSUMER = fbs.LossReason.SLOW_CONSUMER
    CONNECTION_LOST = fbs.LossReason.CONNECTION_LOST
    WORKER_RESTART = fbs.LossReason.WORKER_RESTART
    SHUTDOWN = fbs.LossReason.SHUTDOWN
    UNACCOUNTED = fbs.LossReason.UNACCOUNTED
    EVICTED = fbs.LossReason.EVICTED
    EPOCH_CHANGED = fbs.LossReason.EPOCH_CHANGED
    GROUP_OVERFLOW = fbs.LossReason.GROUP_OVERFLOW
    MAX_DELIVERIES = fbs.LossReason.MAX_DELIVERIES
    UNACKED_LOST = fbs.LossReason.UNACKED_LOST

    NAMES: ClassVar[dict[int, str]] = {
        0: "unknown",
        1: "slow_consumer",
        2: "connection_lost",
        3: "worker_restart",
        4: "shutdown",
        5: "unaccounted",
        6: "evicted",
        7: "epoch_changed",
        8: "group_overflow",
        9: "max_deliveries",
        10: "unacked_lost",
    }

    @classmethod
    def name(cls, reason: int) -> str:
        """The reason's name in lower case ("worker_restart"), or "reason_N" for one this
        version does not know."""
        return cls.NAMES.get(reason, f"reason_{reason}")


class PreviousConnection(NamedTuple):
    """A reconnecting client's account of its previous connection (Hello.previous)."""

    connection_id: int
    received: int = 0  # deliveries received on it
    told_lost: int = 0  # sum of the LossNotice.dropped received on it
    resume_token: bytes | None = None  # its Welcome.resume_token: the proof of the claim
    group_received: int = 0  # version 3: of `received`, those a Delivery frame announced


class Hello(NamedTuple):
    protocol_version: int = PROTOCOL_VERSION
    worker: int = ANY_WORKER
    client_name: str | None = None
    auth_token: str | None = None
    previous: PreviousConnection | None = None
    positions: bool = False  # resubscribes `since` its positions: queued deliveries are replayed, not told
    tls: bool = False  # asks for TLS: sent in plain text, no secret; the real Hello follows inside TLS


class Resumed(NamedTuple):
    """The server's account of the connection named by Hello.previous (Welcome.resumed)."""

    connection_id: int
    processed: int  # the first `processed` publishes sent on it were processed, the rest never
    refused: int = 0  # of those, refused with NOT_MY_VBUCKET (an Error carried each back)


class Welcome(NamedTuple):
    node_id: str
    worker: int
    map: VBucketMap
    max_frame_bytes: int
    max_pending_bytes: int
    connection_id: int = 0
    server_version: str | None = None
    protocol_version: int = PROTOCOL_VERSION
    resumed: Resumed | None = None
    resume_token: bytes | None = None  # RESUME_TOKEN_BYTES random bytes: the secret of this connection


class Position(NamedTuple):
    """A message's place in its vbucket's sequence (stamped by the owning worker)."""

    vbucket: int
    epoch: int
    offset: int


class Subscribe(NamedTuple):
    sid: int
    pattern: bytes
    key_partition: bytes | None = None
    since: tuple[Position, ...] = ()  # per vbucket: the last position the client has
    since_time: int = 0  # ns: for the vbuckets `since` does not name (0: not set)
    last: int = 0  # for the vbuckets neither names: the last N retained (0: live only)
    # Version 3: groups and acknowledgements (schema/README.md 5.3, 5.4; 0 or empty: the default).
    group: str | None = None
    key_shared: bool = False
    ack: bool = False
    ack_wait_ms: int = 0
    max_deliveries: int = 0
    backoff_ms: tuple[int, ...] = ()
    max_in_flight: int = 0
    max_in_flight_bytes: int = 0
    dead_letter: bytes | None = None
    drain_timeout_ms: int = 0


class Unsubscribe(NamedTuple):
    sid: int


class Pause(NamedTuple):
    pass


class Resume(NamedTuple):
    pass


class Ping(NamedTuple):
    id: int = 0


class Pong(NamedTuple):
    id: int = 0
    ts: int = 0  # the server's clock (ns) as stamped on the messages of the Ping's read
    behind: int = 0  # messages the connection is owed while it lags (schema/README.md 7); 0: live


class Error(NamedTuple):
    code: int
    message: str | None = None
    map_version: int = 0
    fatal: bool = False
    sid: int = 0
    refused: bytes | None = None  # NOT_MY_VBUCKET for a publish: the refused Message frame
    rid: int = 0  # the read concerned (schema/README.md 5.2), 0: none


class LossNotice(NamedTuple):
    dropped: int
    reason: int = LossReason.SLOW_CONSUMER
    sid: int = 0  # the subscription concerned (a start from positions), 0: the connection's deliveries
    at: Position | None = None  # with sid: the first position missing
    through: Position | None = None  # with sid: the last position it accounts for (a start goes on after)


class Replay(NamedTuple):
    """Server -> client: the next `messages` Message frames are retained messages for one
    subscription (sid) or read (rid) only (schema/README.md 5.1)."""

    sid: int
    messages: int
    ts: int = 0  # the server's clock (ns) when the Subscribe or Read was processed
    rid: int = 0


class Delivery(NamedTuple):
    """Server -> client (version 3): the next `messages` Message frames are for group member
    `sid` alone; attempt: how many times they have been delivered, this one included."""

    sid: int
    messages: int
    attempt: int = 1


class AckKind:
    """Values of the AckKind enum of the Ack frame."""

    ACK = fbs.AckKind.ACK
    NACK = fbs.AckKind.NACK
    IN_PROGRESS = fbs.AckKind.IN_PROGRESS


class Ack(NamedTuple):
    """Client -> server (version 3): acknowledge deliveries of ack subscription `sid`."""

    sid: int
    kind: int
    positions: tuple[Position, ...]
    delay_ms: int = -1  # NACK: ms before the redelivery; -1: the subscription's backoff


class GroupEvent:
    """Values of the GroupEvent enum of the GroupNotice frame."""

    PAUSED = fbs.GroupEvent.PAUSED
    RESUMED = fbs.GroupEvent.RESUMED
    DRAIN_EXPIRED = fbs.GroupEvent.DRAIN_EXPIRED


class GroupNotice(NamedTuple):
    """Server -> client (version 3): a group member's pause, resume or drain deadline."""

    sid: int
    event: int
    messages: int = 0  # PAUSED, RESUMED: in flight; DRAIN_EXPIRED: not acknowledged by the old member
    vbucket: int = 0


# The frames (body types 18 to 20) that version 3 added: unknown on a version-2 connection.
VERSION_3_FRAMES: frozenset[type] = frozenset((Delivery, Ack, GroupNotice))


class Goodbye(NamedTuple):
    reason: str | None = None
    processed: int = 0  # publishes of the connection processed before the Goodbye


class MapUpdate(NamedTuple):
    """Server -> client: the vbucket map changed."""

    map: VBucketMap


class MapApplied(NamedTuple):
    """Client -> server: the client applied the map with this version."""

    version: int


class Read(NamedTuple):
    """Client -> server: a bounded read of retained messages (schema/README.md 5.2)."""

    rid: int
    pattern: bytes
    key_partition: bytes | None = None
    start: tuple[Position, ...] = ()  # per vbucket: read after this position
    start_time: int = 0  # ns: for the vbuckets `start` does not name (0: from the oldest retained)
    stop: tuple[Position, ...] = ()  # per vbucket: up to this position (else: up to now)
    vbuckets: tuple[int, ...] = ()  # only these vbuckets (else: every one the worker owns)


class ReadDone(NamedTuple):
    """Server -> client: one vbucket of read `rid` is done."""

    rid: int
    vbucket: int
    epoch: int
    next: int  # the first offset after the range
    evicted: int = 0  # offsets of the range gone before they could be read
    epoch_changed: bool = False  # the start named an epoch that is gone
    remaining: int = 0  # ReadDones of this read still to come
    moved: bool = False  # the vbucket went on at another worker from `next` (a planned move)


Frame = (
    Message | Hello | Welcome | Subscribe | Unsubscribe | Pause | Resume | Ping | Pong | Error
    | LossNotice | Goodbye | MapUpdate | MapApplied | Read | ReadDone | Replay | Delivery | Ack
    | GroupNotice
)  # fmt: skip


# ---------------------------------------------------------------- encoding

_F = TypeVar("_F")


def _encoder(encode: Callable[[_F], bytes]) -> Callable[[_F], bytes]:
    """Turn the Builder's errors for values the schema cannot carry into LocalProtocolError."""

    @functools.wraps(encode)
    def checked(frame: _F) -> bytes:
        try:
            return encode(frame)
        except (TypeError, ValueError, OverflowError, struct.error) as exc:
            raise LocalProtocolError(f"cannot encode {frame!r:.200}: {exc}") from None

    return checked


def _string(b: flatbuffers.Builder, text: str) -> int:
    # The Builder also takes bytes, and would write bytes that are not UTF-8.
    if not isinstance(text, str):
        raise TypeError(f"a string field takes str, not {type(text).__name__}")
    return int(b.CreateString(text))


def _bytes_field(value: bytes, what: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"{what} takes bytes, not {type(value).__name__}")
    return bytes(value)


def _finish(builder: flatbuffers.Builder, body_type: int, body: int) -> bytes:
    fbs.FrameStart(builder)
    fbs.FrameAddBodyType(builder, body_type)
    fbs.FrameAddBody(builder, body)
    builder.FinishSizePrefixed(fbs.FrameEnd(builder), FILE_IDENTIFIER)
    return bytes(builder.Output())


@_encoder
def encode_hello(hello: Hello) -> bytes:
    b = flatbuffers.Builder(64)
    name = _string(b, hello.client_name) if hello.client_name is not None else 0
    token = _string(b, hello.auth_token) if hello.auth_token is not None else 0
    previous = 0
    if hello.previous is not None:
        proof = 0
        if hello.previous.resume_token is not None:
            proof = b.CreateByteVector(_bytes_field(hello.previous.resume_token, "resume_token"))
        fbs.PreviousConnectionStart(b)
        fbs.PreviousConnectionAddConnectionId(b, hello.previous.connection_id)
        fbs.PreviousConnectionAddReceived(b, hello.previous.received)
        fbs.PreviousConnectionAddToldLost(b, hello.previous.told_lost)
        if hello.previous.group_received:
            fbs.PreviousConnectionAddGroupReceived(b, hello.previous.group_received)
        if proof:
            fbs.PreviousConnectionAddResumeToken(b, proof)
        previous = fbs.PreviousConnectionEnd(b)
    fbs.HelloStart(b)
    fbs.HelloAddProtocolVersion(b, hello.protocol_version)
    fbs.HelloAddWorker(b, hello.worker)
    if name:
        fbs.HelloAddClientName(b, name)
    if token:
        fbs.HelloAddAuthToken(b, token)
    if previous:
        fbs.HelloAddPrevious(b, previous)
    if hello.positions:
        fbs.HelloAddPositions(b, True)
    if hello.tls:
        fbs.HelloAddTls(b, True)
    return _finish(b, Body.Hello, fbs.HelloEnd(b))


def _owner_vector(b: flatbuffers.Builder, owners: tuple[tuple[int, int], ...]) -> int:
    """A vector of VBucketOwner structs (ushort node, ushort worker: 4 bytes, no padding),
    written in one slice: the bytes 1024 `fbs.CreateVBucketOwner` calls would write, in a
    tenth of the time (the Python builder's per-field prepends made a map's encoding cost
    ~15 ms, paid by every worker for every map it takes, and by every test that builds a
    Shard)."""
    data = struct.pack(f"<{2 * len(owners)}H", *[half for owner in owners for half in owner])
    b.StartVector(4, len(owners), 2)  # = fbs.VBucketMapStartOwnersVector: room, alignment
    b.head -= len(data)
    b.Bytes[b.head : b.head + len(data)] = data
    return int(b.EndVector())


def _encode_map(b: flatbuffers.Builder, vmap: VBucketMap) -> int:
    nodes = []
    for node in vmap.nodes:
        node_id = _string(b, node.node_id)
        host = _string(b, node.host)
        fbs.NodeStart(b)
        fbs.NodeAddNodeId(b, node_id)
        fbs.NodeAddHost(b, host)
        fbs.NodeAddPort(b, node.port)
        fbs.NodeAddWorkers(b, node.workers)
        nodes.append(fbs.NodeEnd(b))
    fbs.VBucketMapStartNodesVector(b, len(nodes))
    for node_off in reversed(nodes):
        b.PrependUOffsetTRelative(node_off)
    nodes_vec = b.EndVector()
    owners_vec = _owner_vector(b, vmap.owners)
    incoming_vec = 0 if vmap.incoming is None else _owner_vector(b, vmap.incoming)
    fbs.VBucketMapStart(b)
    fbs.VBucketMapAddVersion(b, vmap.version)
    fbs.VBucketMapAddNodes(b, nodes_vec)
    fbs.VBucketMapAddOwners(b, owners_vec)
    if vmap.incoming is not None:
        fbs.VBucketMapAddIncoming(b, incoming_vec)
    return int(fbs.VBucketMapEnd(b))


@_encoder
def encode_welcome(welcome: Welcome) -> bytes:
    b = flatbuffers.Builder(8192)
    vmap = _encode_map(b, welcome.map)
    node_id = _string(b, welcome.node_id)
    version = _string(b, welcome.server_version) if welcome.server_version is not None else 0
    resumed = 0
    if welcome.resumed is not None:
        fbs.ResumedStart(b)
        fbs.ResumedAddConnectionId(b, welcome.resumed.connection_id)
        fbs.ResumedAddProcessed(b, welcome.resumed.processed)
        fbs.ResumedAddRefused(b, welcome.resumed.refused)
        resumed = fbs.ResumedEnd(b)
    proof = 0
    if welcome.resume_token is not None:
        proof = b.CreateByteVector(_bytes_field(welcome.resume_token, "resume_token"))
    fbs.WelcomeStart(b)
    fbs.WelcomeAddProtocolVersion(b, welcome.protocol_version)
    if welcome.server_version is not None:
        fbs.WelcomeAddServerVersion(b, version)
    fbs.WelcomeAddNodeId(b, node_id)
    fbs.WelcomeAddWorker(b, welcome.worker)
    fbs.WelcomeAddMap(b, vmap)
    fbs.WelcomeAddMaxFrameBytes(b, welcome.max_frame_bytes)
    fbs.WelcomeAddMaxPendingBytes(b, welcome.max_pending_bytes)
    fbs.WelcomeAddConnectionId(b, welcome.connection_id)
    if resumed:
        fbs.WelcomeAddResumed(b, resumed)
    if proof:
        fbs.WelcomeAddResumeToken(b, proof)
    return _finish(b, Body.Welcome, fbs.WelcomeEnd(b))


class WelcomeTemplate:
    """A Welcome encoded once; `for_connection` patches only connection_id, the
    resume token's bytes (and the fields of `resumed`, for a reconnecting client).

    Encoding the 1024-entry map costs milliseconds, too much per connection:
    after a worker restart every client of that worker reconnects at once.
    """

    _CONNECTION_ID_FIELD = 7
    _RESUMED_FIELD = 8
    _RESUME_TOKEN_FIELD = 9

    def __init__(self, welcome: Welcome) -> None:
        # Non-default placeholders force the Builder to write the fields.
        ones = (1 << 64) - 1
        token = bytes(RESUME_TOKEN_BYTES)
        self._bytes = encode_welcome(welcome._replace(connection_id=ones, resumed=None, resume_token=token))
        self._pos = self._field(self._bytes, None)
        self._token_pos = self._token_at(self._bytes)
        self._resumed_bytes = encode_welcome(
            welcome._replace(connection_id=ones, resumed=Resumed(ones, ones, ones), resume_token=token)
        )
        self._resumed_pos = self._field(self._resumed_bytes, None)
        self._resumed_token_pos = self._token_at(self._resumed_bytes)
        self._resumed_fields = tuple(self._field(self._resumed_bytes, i) for i in range(3))

    @classmethod
    def _field(cls, frame: bytes, resumed_field: int | None) -> int:
        body = root(frame, 0, len(frame)).table(1)
        assert body is not None
        if resumed_field is None:
            pos = body.field(cls._CONNECTION_ID_FIELD, 8)
        else:
            resumed = body.table(cls._RESUMED_FIELD)
            assert resumed is not None
            pos = resumed.field(resumed_field, 8)
        assert pos
        return pos

    @classmethod
    def _token_at(cls, frame: bytes) -> int:
        body = root(frame, 0, len(frame)).table(1)
        assert body is not None
        pos, n = body.vector(cls._RESUME_TOKEN_FIELD, 1)
        assert pos and n == RESUME_TOKEN_BYTES
        return pos

    def for_connection(self, connection_id: int, token: bytes, resumed: Resumed | None = None) -> bytes:
        """The Welcome of connection `connection_id`, whose secret is `token`
        (RESUME_TOKEN_BYTES bytes), resuming the account `resumed` if any."""
        if len(token) != RESUME_TOKEN_BYTES:
            raise LocalProtocolError(f"resume_token must be {RESUME_TOKEN_BYTES} bytes, got {len(token)}")
        if resumed is None:
            out = bytearray(self._bytes)
            _u64_into(out, self._pos, connection_id)
            out[self._token_pos : self._token_pos + RESUME_TOKEN_BYTES] = token
            return bytes(out)
        out = bytearray(self._resumed_bytes)
        _u64_into(out, self._resumed_pos, connection_id)
        out[self._resumed_token_pos : self._resumed_token_pos + RESUME_TOKEN_BYTES] = token
        at = self._resumed_fields
        _u64_into(out, at[0], resumed.connection_id)
        _u64_into(out, at[1], resumed.processed)
        _u64_into(out, at[2], resumed.refused)
        return bytes(out)


@_encoder
def encode_map_update(update: MapUpdate) -> bytes:
    b = flatbuffers.Builder(8192)
    vmap = _encode_map(b, update.map)
    fbs.MapUpdateStart(b)
    fbs.MapUpdateAddMap(b, vmap)
    return _finish(b, Body.MapUpdate, fbs.MapUpdateEnd(b))


@_encoder
def encode_map_applied(applied: MapApplied) -> bytes:
    b = flatbuffers.Builder(32)
    fbs.MapAppliedStart(b)
    fbs.MapAppliedAddVersion(b, applied.version)
    return _finish(b, Body.MapApplied, fbs.MapAppliedEnd(b))


def _positions(
    b: flatbuffers.Builder, start_vector: Callable[[Any, int], Any], at: tuple[Position, ...]
) -> int:
    """A vector of Position structs (written last to first, as the Builder wants)."""
    start_vector(b, len(at))
    for p in reversed(at):
        fbs.CreatePosition(b, p.epoch, p.offset, p.vbucket)
    return int(b.EndVector())


@_encoder
def encode_subscribe(sub: Subscribe) -> bytes:
    b = flatbuffers.Builder(64 + 24 * len(sub.since))
    pattern = b.CreateByteVector(sub.pattern)
    kp = b.CreateByteVector(sub.key_partition) if sub.key_partition is not None else 0
    since = _positions(b, fbs.SubscribeStartSinceVector, sub.since) if sub.since else 0
    group = _string(b, sub.group) if sub.group is not None else 0
    backoff = 0
    if sub.backoff_ms:
        fbs.SubscribeStartBackoffMsVector(b, len(sub.backoff_ms))
        for ms in reversed(sub.backoff_ms):
            b.PrependUint32(ms)
        backoff = b.EndVector()
    dead_letter = b.CreateByteVector(sub.dead_letter) if sub.dead_letter is not None else 0
    fbs.SubscribeStart(b)
    fbs.SubscribeAddSid(b, sub.sid)
    fbs.SubscribeAddPattern(b, pattern)
    if sub.key_partition is not None:
        fbs.SubscribeAddKeyPartition(b, kp)
    if since:
        fbs.SubscribeAddSince(b, since)
    if sub.since_time:
        fbs.SubscribeAddSinceTime(b, sub.since_time)
    if sub.last:
        fbs.SubscribeAddLast(b, sub.last)
    if sub.group is not None:
        fbs.SubscribeAddGroup(b, group)
    if sub.key_shared:
        fbs.SubscribeAddKeyShared(b, sub.key_shared)
    if sub.ack:
        fbs.SubscribeAddAck(b, sub.ack)
    if sub.ack_wait_ms:
        fbs.SubscribeAddAckWaitMs(b, sub.ack_wait_ms)
    if sub.max_deliveries:
        fbs.SubscribeAddMaxDeliveries(b, sub.max_deliveries)
    if backoff:
        fbs.SubscribeAddBackoffMs(b, backoff)
    if sub.max_in_flight:
        fbs.SubscribeAddMaxInFlight(b, sub.max_in_flight)
    if sub.max_in_flight_bytes:
        fbs.SubscribeAddMaxInFlightBytes(b, sub.max_in_flight_bytes)
    if sub.dead_letter is not None:
        fbs.SubscribeAddDeadLetter(b, dead_letter)
    if sub.drain_timeout_ms:
        fbs.SubscribeAddDrainTimeoutMs(b, sub.drain_timeout_ms)
    return _finish(b, Body.Subscribe, fbs.SubscribeEnd(b))


@_encoder
def encode_ack(ack: Ack) -> bytes:
    b = flatbuffers.Builder(32 + 24 * len(ack.positions))
    positions = _positions(b, fbs.AckStartPositionsVector, ack.positions) if ack.positions else 0
    fbs.AckStart(b)
    fbs.AckAddSid(b, ack.sid)
    fbs.AckAddKind(b, ack.kind)
    if positions:
        fbs.AckAddPositions(b, positions)
    if ack.delay_ms != -1:
        fbs.AckAddDelayMs(b, ack.delay_ms)
    return _finish(b, Body.Ack, fbs.AckEnd(b))


@_encoder
def encode_group_notice(notice: GroupNotice) -> bytes:
    b = flatbuffers.Builder(48)
    fbs.GroupNoticeStart(b)
    fbs.GroupNoticeAddSid(b, notice.sid)
    fbs.GroupNoticeAddEvent(b, notice.event)
    fbs.GroupNoticeAddMessages(b, notice.messages)
    fbs.GroupNoticeAddVbucket(b, notice.vbucket)
    return _finish(b, Body.GroupNotice, fbs.GroupNoticeEnd(b))


@_encoder
def encode_read(read: Read) -> bytes:
    b = flatbuffers.Builder(64 + 24 * (len(read.start) + len(read.stop)) + 2 * len(read.vbuckets))
    pattern = b.CreateByteVector(read.pattern)
    kp = b.CreateByteVector(read.key_partition) if read.key_partition is not None else 0
    start = _positions(b, fbs.ReadStartStartVector, read.start) if read.start else 0
    stop = _positions(b, fbs.ReadStartStopVector, read.stop) if read.stop else 0
    vbuckets = 0
    if read.vbuckets:
        fbs.ReadStartVbucketsVector(b, len(read.vbuckets))
        for vb in reversed(read.vbuckets):
            b.PrependUint16(vb)
        vbuckets = b.EndVector()
    fbs.ReadStart(b)
    fbs.ReadAddRid(b, read.rid)
    fbs.ReadAddPattern(b, pattern)
    if read.key_partition is not None:
        fbs.ReadAddKeyPartition(b, kp)
    if start:
        fbs.ReadAddStart(b, start)
    if read.start_time:
        fbs.ReadAddStartTime(b, read.start_time)
    if stop:
        fbs.ReadAddStop(b, stop)
    if vbuckets:
        fbs.ReadAddVbuckets(b, vbuckets)
    return _finish(b, Body.Read, fbs.ReadEnd(b))


@_encoder
def encode_unsubscribe(unsub: Unsubscribe) -> bytes:
    b = flatbuffers.Builder(32)
    fbs.UnsubscribeStart(b)
    fbs.UnsubscribeAddSid(b, unsub.sid)
    return _finish(b, Body.Unsubscribe, fbs.UnsubscribeEnd(b))


def _encode_empty(body_type: int) -> bytes:
    b = flatbuffers.Builder(32)
    b.StartObject(0)
    return _finish(b, body_type, b.EndObject())


PAUSE = _encode_empty(Body.Pause)
RESUME = _encode_empty(Body.Resume)


def _id_template(
    body_type: int,
    start: Callable[[Any], None],
    add_id: Callable[[Any, int], None],
    end: Callable[[Any], int],
) -> tuple[bytes, int]:
    """A Ping or Pong frame with the id field present, and the position of that id.

    Pings and Pongs are frequent (the SDK confirms its publishes with them, every
    few milliseconds while publishing): they are patched copies of one frame,
    not Builder output (tens of microseconds each).
    """
    b = flatbuffers.Builder(32)
    start(b)
    add_id(b, (1 << 64) - 1)  # not the default (0): the field is written
    frame = _finish(b, body_type, end(b))
    body = root(frame, 0, len(frame)).table(1)
    assert body is not None
    return frame, body.field(0, 8)


_PING = _id_template(Body.Ping, fbs.PingStart, fbs.PingAddId, fbs.PingEnd)
_pack_u64 = struct.Struct("<Q").pack


def _pong_template() -> tuple[bytes, int, int]:
    """A Pong with its id and ts present, and the positions of both (patched per Pong)."""
    b = flatbuffers.Builder(32)
    fbs.PongStart(b)
    fbs.PongAddId(b, (1 << 64) - 1)  # not the defaults: the fields are written
    fbs.PongAddTs(b, -1)
    frame = _finish(b, Body.Pong, fbs.PongEnd(b))
    body = root(frame, 0, len(frame)).table(1)
    assert body is not None
    return frame, body.field(0, 8), body.field(1, 8)


_PONG_FRAME, _PONG_ID_AT, _PONG_TS_AT = _pong_template()
_pong_into = struct.Struct("<Q").pack_into
_pong_ts_into = struct.Struct("<q").pack_into


def _patched(template: tuple[bytes, int], value: int, what: str) -> bytes:
    frame, pos = template
    try:
        return frame[:pos] + _pack_u64(value) + frame[pos + 8 :]
    except (struct.error, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode {what} id {value!r:.100}: {exc}") from None


def encode_ping(ping: Ping) -> bytes:
    return _patched(_PING, ping.id, "Ping")


_PING_SIZE = len(_PING[0])
PING_SIZE_PREFIX = _PING_SIZE - 4  # the size prefix of such a Ping: no Message is this small
_PING_HEAD = _PING[0][: _PING[1]]  # everything before the id (the id is last: no tail)
assert _PING[1] + 8 == _PING_SIZE
_u64 = struct.Struct("<Q").unpack_from


def ping_id(buf: Buffer, f: int, end: int) -> int | None:
    """The id of the Ping frame in buf[f:end] if it has the layout `encode_ping`
    writes (the server's fast path for the confirmation Pings the SDK sends while
    publishing), else None: any other frame, or a Ping laid out otherwise, which
    `decode_frame` reads."""
    if end - f != _PING_SIZE or buf[f : f + _PING_SIZE - 8] != _PING_HEAD:
        return None
    value: int = _u64(buf, f + _PING_SIZE - 8)[0]
    return value


def encode_pong(pong: Pong) -> bytes:
    if pong.behind:  # a lagging connection's (rare): built, not patched
        return _encode_pong_behind(pong)
    out = bytearray(_PONG_FRAME)
    try:
        _pong_into(out, _PONG_ID_AT, pong.id)
        _pong_ts_into(out, _PONG_TS_AT, pong.ts)
    except (struct.error, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode {pong!r:.100}: {exc}") from None
    return bytes(out)


@_encoder
def _encode_pong_behind(pong: Pong) -> bytes:
    b = flatbuffers.Builder(64)
    fbs.PongStart(b)
    fbs.PongAddId(b, pong.id)
    fbs.PongAddTs(b, pong.ts)
    fbs.PongAddBehind(b, pong.behind)
    return _finish(b, Body.Pong, fbs.PongEnd(b))


@_encoder
def encode_error(error: Error) -> bytes:
    b = flatbuffers.Builder(128 + (len(error.refused) if error.refused else 0))
    refused = b.CreateByteVector(error.refused) if error.refused is not None else 0
    text = _string(b, error.message) if error.message is not None else 0
    fbs.ErrorStart(b)
    fbs.ErrorAddCode(b, int(error.code))
    if text:
        fbs.ErrorAddMessage(b, text)
    fbs.ErrorAddMapVersion(b, error.map_version)
    fbs.ErrorAddFatal(b, error.fatal)
    fbs.ErrorAddSid(b, error.sid)
    if refused:
        fbs.ErrorAddRefused(b, refused)
    if error.rid:
        fbs.ErrorAddRid(b, error.rid)
    return _finish(b, Body.Error, fbs.ErrorEnd(b))


@_encoder
def encode_loss_notice(notice: LossNotice) -> bytes:
    if notice.at is None and notice.through is None:  # a connection's: a patched copy (_LOSS)
        return _LOSS.encode((notice.dropped, notice.reason, notice.sid))
    b = flatbuffers.Builder(32)
    fbs.LossNoticeStart(b)
    fbs.LossNoticeAddDropped(b, notice.dropped)
    fbs.LossNoticeAddReason(b, notice.reason)
    if notice.sid:
        fbs.LossNoticeAddSid(b, notice.sid)
    if notice.at is not None:
        at = notice.at
        fbs.LossNoticeAddAt(b, fbs.CreatePosition(b, at.epoch, at.offset, at.vbucket))
    if notice.through is not None:
        through = notice.through
        fbs.LossNoticeAddThrough(b, fbs.CreatePosition(b, through.epoch, through.offset, through.vbucket))
    return _finish(b, Body.LossNotice, fbs.LossNoticeEnd(b))


class _Scalars:
    """A frame of scalar fields only, each written even at its default, and one struct
    over their positions: a frame that goes out by the hundred (a bounded read's
    Replay and ReadDone, one per vbucket) is a patched copy of it, not Builder
    output (tens of microseconds each)."""

    def __init__(
        self,
        body_type: int,
        start: Callable[[Any], None],
        end: Callable[[Any], int],
        fields: list[tuple[Callable[[Any, Any], None], str]],
    ) -> None:
        b = flatbuffers.Builder(64)
        b.ForceDefaults(True)  # every field written: each has a place to patch
        start(b)
        for add, _ in fields:
            add(b, 0)
        self.frame = _finish(b, body_type, end(b))
        body = root(self.frame, 0, len(self.frame)).table(1)
        assert body is not None
        at = [(body.field(i, struct.calcsize("<" + code)), code, i) for i, (_, code) in enumerate(fields)]
        at.sort()
        self.order = [i for _, _, i in at]  # field indexes by position
        self.pack = struct_at(*((pos, code) for pos, code, _ in at), start=at[0][0]).pack_into
        self.first = at[0][0]

    def encode(self, values: tuple[Any, ...]) -> bytes:
        out = bytearray(self.frame)
        self.pack(out, self.first, *(values[i] for i in self.order))
        return bytes(out)


_REPLAY = _Scalars(
    Body.Replay,
    fbs.ReplayStart,
    fbs.ReplayEnd,
    [(fbs.ReplayAddSid, "I"), (fbs.ReplayAddRid, "I"), (fbs.ReplayAddMessages, "I"), (fbs.ReplayAddTs, "q")],
)
_READ_DONE_FIELDS: list[tuple[Callable[[Any, Any], None], str]] = [
    (fbs.ReadDoneAddRid, "I"),
    (fbs.ReadDoneAddVbucket, "H"),
    (fbs.ReadDoneAddEpoch, "Q"),
    (fbs.ReadDoneAddNext, "Q"),
    (fbs.ReadDoneAddEvicted, "Q"),
    (fbs.ReadDoneAddEpochChanged, "?"),
    (fbs.ReadDoneAddRemaining, "H"),
]
_READ_DONE = _Scalars(Body.ReadDone, fbs.ReadDoneStart, fbs.ReadDoneEnd, _READ_DONE_FIELDS)
# `moved` is written only when true: a ReadDone of a vbucket owned here is as before it existed.
_READ_DONE_MOVED = _Scalars(
    Body.ReadDone, fbs.ReadDoneStart, fbs.ReadDoneEnd, [*_READ_DONE_FIELDS, (fbs.ReadDoneAddMoved, "?")]
)


# A LossNotice without positions: a slow consumer's, told each time deliveries resume after
# drops (broky.server.shard.backpressure), so not Builder output.
_LOSS = _Scalars(
    Body.LossNotice,
    fbs.LossNoticeStart,
    fbs.LossNoticeEnd,
    [(fbs.LossNoticeAddDropped, "Q"), (fbs.LossNoticeAddReason, "B"), (fbs.LossNoticeAddSid, "I")],
)
_DELIVERY = _Scalars(
    Body.Delivery,
    fbs.DeliveryStart,
    fbs.DeliveryEnd,
    [(fbs.DeliveryAddSid, "I"), (fbs.DeliveryAddMessages, "I"), (fbs.DeliveryAddAttempt, "I")],
)


@_encoder
def encode_delivery(delivery: Delivery) -> bytes:
    return _DELIVERY.encode(delivery)


@_encoder
def encode_replay(replay: Replay) -> bytes:
    return _REPLAY.encode((replay.sid, replay.rid, replay.messages, replay.ts))


@_encoder
def encode_read_done(done: ReadDone) -> bytes:
    if type(done.epoch_changed) is not bool:  # struct's "?" would take any value
        raise TypeError(f"epoch_changed takes a bool, not {type(done.epoch_changed).__name__}")
    if type(done.moved) is not bool:
        raise TypeError(f"moved takes a bool, not {type(done.moved).__name__}")
    return (_READ_DONE_MOVED if done.moved else _READ_DONE).encode(done)


@_encoder
def encode_goodbye(goodbye: Goodbye) -> bytes:
    b = flatbuffers.Builder(64)
    text = _string(b, goodbye.reason) if goodbye.reason is not None else 0
    fbs.GoodbyeStart(b)
    if text:
        fbs.GoodbyeAddReason(b, text)
    fbs.GoodbyeAddProcessed(b, goodbye.processed)
    return _finish(b, Body.Goodbye, fbs.GoodbyeEnd(b))


def encode_frame(frame: Frame) -> bytes:
    """Encode any frame value (Message frames take the fast path).

    Raises:
        LocalProtocolError: not a frame value, or a field the schema cannot
            carry (wrong type, out of its range, a uid that is not 20 bytes).
    """
    if isinstance(frame, Message):
        from broky.protocol.message import encode_message

        return encode_message(*frame)
    if isinstance(frame, Pause):
        return PAUSE
    if isinstance(frame, Resume):
        return RESUME
    encoder = _ENCODERS.get(type(frame))
    if encoder is None:
        raise LocalProtocolError(f"not a Broky frame: {frame!r:.200}")
    return encoder(frame)


_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    Hello: encode_hello,
    Welcome: encode_welcome,
    Subscribe: encode_subscribe,
    Unsubscribe: encode_unsubscribe,
    Ping: encode_ping,
    Pong: encode_pong,
    Error: encode_error,
    LossNotice: encode_loss_notice,
    Goodbye: encode_goodbye,
    MapUpdate: encode_map_update,
    MapApplied: encode_map_applied,
    Read: encode_read,
    ReadDone: encode_read_done,
    Replay: encode_replay,
    Delivery: encode_delivery,
    Ack: encode_ack,
    GroupNotice: encode_group_notice,
}


# ---------------------------------------------------------------- decoding


def _required(value: object, what: str) -> object:
    if value is None:
        raise malformed(f"{what} is required")
    return value


def _decode_map(t: Table) -> VBucketMap:
    nodes_start, n_nodes = t.vector(1, 4)
    if not nodes_start:
        raise malformed("VBucketMap.nodes is required")
    nodes = []
    for i in range(n_nodes):
        node = t.table_at(nodes_start + 4 * i)
        nodes.append(
            NodeInfo(
                str(_required(node.string(0), "Node.node_id")),
                str(_required(node.string(1), "Node.host")),
                node.u16(2),
                node.u16(3),
            )
        )
    owners_start, n_owners = t.vector(2, 4)
    if not owners_start:
        raise malformed("VBucketMap.owners is required")
    if n_owners != VBUCKETS:
        raise malformed(f"VBucketMap.owners has {n_owners} entries, not {VBUCKETS}")
    raw = bytes(t.buf[owners_start : owners_start + 4 * n_owners])
    owners = tuple(struct.iter_unpack("<HH", raw))
    for node_index, _ in owners:
        if node_index >= n_nodes:
            raise malformed(f"vbucket owner names node {node_index} of {n_nodes}")
    incoming = None
    incoming_start, n_incoming = t.vector(3, 4)
    if incoming_start:
        if n_incoming != VBUCKETS:
            raise malformed(f"VBucketMap.incoming has {n_incoming} entries, not {VBUCKETS}")
        raw = bytes(t.buf[incoming_start : incoming_start + 4 * n_incoming])
        incoming = tuple(struct.iter_unpack("<HH", raw))
        for owner in incoming:
            if owner[0] >= n_nodes and owner != NO_OWNER:
                raise malformed(f"incoming vbucket owner names node {owner[0]} of {n_nodes}")
    return VBucketMap(t.u64(0), tuple(nodes), owners, incoming)


def _decode_body(kind: int, t: Table) -> Frame:
    if kind == Body.Hello:
        prev = t.table(4)
        previous = (
            None
            if prev is None
            else PreviousConnection(prev.u64(0), prev.u64(1), prev.u64(2), prev.byte_vector(3), prev.u64(4))
        )
        return Hello(
            t.u16(0, 1), t.i16(1, -1), t.string(2), t.string(3), previous, t.boolean(5), t.boolean(6)
        )
    if kind == Body.Welcome:
        vmap = t.table(4)
        res = t.table(8)
        return Welcome(
            node_id=str(_required(t.string(2), "Welcome.node_id")),
            worker=t.u16(3),
            map=_decode_map(_required(vmap, "Welcome.map")),  # type: ignore[arg-type]
            max_frame_bytes=t.u32(5),
            max_pending_bytes=t.u64(6),
            connection_id=t.u64(7),
            server_version=t.string(1),
            protocol_version=t.u16(0, 1),
            resumed=None if res is None else Resumed(res.u64(0), res.u64(1), res.u64(2)),
            resume_token=t.byte_vector(9),
        )
    if kind == Body.Subscribe:
        pattern = t.byte_vector(1)
        return Subscribe(
            t.u32(0),
            _required(pattern, "Subscribe.pattern"),  # type: ignore[arg-type]
            t.byte_vector(2),
            _decode_positions(t, 3),
            t.i64(4),
            t.u32(5),
            t.string(6),
            t.boolean(7),
            t.boolean(8),
            t.u32(9),
            t.u32(10),
            _decode_u32s(t, 11),
            t.u32(12),
            t.u64(13),
            t.byte_vector(14),
            t.u32(15),
        )
    if kind == Body.Unsubscribe:
        return Unsubscribe(t.u32(0))
    if kind == Body.Pause:
        return Pause()
    if kind == Body.Resume:
        return Resume()
    if kind == Body.Ping:
        return Ping(t.u64(0))
    if kind == Body.Pong:
        return Pong(t.u64(0), t.i64(1), t.u64(2))
    if kind == Body.Error:
        return Error(t.u16(0), t.string(1), t.u64(2), t.boolean(3), t.u32(4), t.byte_vector(5), t.u32(6))
    if kind == Body.LossNotice:
        positions: list[Position | None] = []
        for slot in (3, 4):  # at, through
            found = t.field(slot, _position.size)
            if found:
                epoch, offset, vbucket = _position.unpack_from(t.buf, found)
                positions.append(Position(vbucket, epoch, offset))
            else:
                positions.append(None)
        return LossNotice(t.u64(0), t.u8(1), t.u32(2), positions[0], positions[1])
    if kind == Body.Goodbye:
        return Goodbye(t.string(0), t.u64(1))
    if kind == Body.MapUpdate:
        vmap = t.table(0)
        return MapUpdate(_decode_map(_required(vmap, "MapUpdate.map")))  # type: ignore[arg-type]
    if kind == Body.MapApplied:
        return MapApplied(t.u64(0))
    if kind == Body.Read:
        pattern = t.byte_vector(1)
        return Read(
            t.u32(0),
            _required(pattern, "Read.pattern"),  # type: ignore[arg-type]
            t.byte_vector(2),
            _decode_positions(t, 3),
            t.i64(4),
            _decode_positions(t, 5),
            _decode_u16s(t, 6),
        )
    if kind == Body.ReadDone:
        return ReadDone(
            t.u32(0), t.u16(1), t.u64(2), t.u64(3), t.u64(4), t.boolean(5), t.u16(6), t.boolean(7)
        )
    if kind == Body.Replay:
        return Replay(t.u32(0), t.u32(2), t.i64(3), t.u32(1))
    if kind == Body.Delivery:
        return Delivery(t.u32(0), t.u32(1), t.u32(2))
    if kind == Body.Ack:
        return Ack(t.u32(0), t.u8(1), _decode_positions(t, 2), t.i32(3, -1))
    if kind == Body.GroupNotice:
        return GroupNotice(t.u32(0), t.u8(1), t.u64(2), t.u16(3))
    raise UnknownFrameError(kind)


_position = struct.Struct("<QQH6x")  # the Position struct: epoch, offset, vbucket, padding


def _decode_positions(t: Table, index: int) -> tuple[Position, ...]:
    pos, n = t.vector(index, _position.size)
    out = []
    for i in range(n):
        epoch, offset, vbucket = _position.unpack_from(t.buf, pos + i * _position.size)
        out.append(Position(vbucket, epoch, offset))
    return tuple(out)


def _decode_u16s(t: Table, index: int) -> tuple[int, ...]:
    pos, n = t.vector(index, 2)
    return struct.unpack_from(f"<{n}H", t.buf, pos) if n else ()


def _decode_u32s(t: Table, index: int) -> tuple[int, ...]:
    pos, n = t.vector(index, 4)
    return struct.unpack_from(f"<{n}I", t.buf, pos) if n else ()


def decode_frame(buf: Buffer, f: int = 0, end: int | None = None) -> Frame:
    """Decode the size-prefixed frame in buf[f:end] (end defaults to its size prefix).

    Raises:
        MalformedFrameError: the bytes are not a valid frame, or f/end lie
            outside buf.
        UnknownFrameError: a valid frame of a body type this version does not know.
    """
    if end is None:
        if f < 0 or len(buf) - f < 4:
            raise malformed("shorter than a size prefix")
        end = f + 4 + _u32(buf, f)[0]
        if end > len(buf):
            raise malformed("size prefix larger than the buffer")
    elif f < 0 or end > len(buf):
        raise out_of_buffer(buf, f, end)
    if end - f >= 84 and _canonical(buf, f, end):
        return decode_message(buf, f, end)
    frame = root(buf, f, end)
    kind = frame.u8(0)
    if kind == BODY_MESSAGE:
        return decode_message(buf, f, end)
    if kind == Body.NONE:
        raise malformed("frame has no body")
    body = frame.table(1)
    if body is None:
        if kind > BODY_LAST:
            raise UnknownFrameError(kind)
        raise malformed("frame has no body")
    return _decode_body(kind, body)


def error_frame(
    code: ErrorCode,
    message: str,
    *,
    fatal: bool,
    map_version: int = 0,
    sid: int = 0,
    refused: bytes | None = None,
    rid: int = 0,
) -> bytes:
    """Shortcut used by the server: the encoded Error frame."""
    return encode_error(Error(int(code), message, map_version, fatal, sid, refused, rid))


__all__ = [
    "ANY_WORKER",
    "GROUPS_VERSION",
    "PROTOCOL_VERSION",
    "SERVED_VERSIONS",
    "VERSION_3_FRAMES",
    "Ack",
    "AckKind",
    "Delivery",
    "Error",
    "Frame",
    "Goodbye",
    "GroupEvent",
    "GroupNotice",
    "Hello",
    "LossNotice",
    "LossReason",
    "MalformedFrameError",
    "MapApplied",
    "MapUpdate",
    "Message",
    "Pause",
    "Ping",
    "Pong",
    "PreviousConnection",
    "Replay",
    "Resume",
    "Resumed",
    "Subscribe",
    "Unsubscribe",
    "Welcome",
    "WelcomeTemplate",
    "decode_frame",
    "encode_frame",
    "ping_id",
]
