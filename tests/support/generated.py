"""The protocol tests' reference: Hypothesis strategies for every frame, and a reader and a
writer built on the code flatc generated (broky.fbs), independent of the hand-written codec.

`generated_read` reads a frame through the generated accessors; `Writer` writes one with
`flatbuffers.Builder`, taking drawn choices (field order, defaults forced or omitted, vectors
in any order, unreferenced bytes between); `builder_frames` and `encoded_frames` draw
(value, bytes) pairs; `ONE_OF_EACH` is one value of each frame type, and `BODY_TYPES` each
frame class's union member. A frame added to the schema is added here
(tests/protocol/test_protocol_generated.py fails until it is).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import flatbuffers
from hypothesis import strategies as st

from broky import fbs
from broky.fbs import Body
from broky.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    NO_OWNER,
    RESUME_TOKEN_BYTES,
    VBUCKETS,
    Ack,
    AckKind,
    Delivery,
    Error,
    Frame,
    Goodbye,
    GroupEvent,
    GroupNotice,
    Hello,
    LossNotice,
    MapApplied,
    MapUpdate,
    Message,
    NodeInfo,
    Pause,
    Ping,
    Pong,
    Position,
    PreviousConnection,
    Read,
    ReadDone,
    Replay,
    Resume,
    Resumed,
    Subscribe,
    Unsubscribe,
    VBucketMap,
    Welcome,
    encode_frame,
)

u8 = st.integers(0, 2**8 - 1)


u16 = st.integers(0, 2**16 - 1)


i16 = st.integers(-(2**15), 2**15 - 1)


u32 = st.integers(0, 2**32 - 1)


u64 = st.integers(0, 2**64 - 1)


i64 = st.integers(-(2**63), 2**63 - 1)


# Values near the edges of each width are where encoders go wrong.
i64_edges = i64 | st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63)])


texts = st.text(max_size=40)


uids = st.none() | st.binary(min_size=20, max_size=20)


messages = st.builds(
    Message,
    key_partition=st.binary(max_size=80),
    key=st.binary(max_size=120),
    payload=st.binary(max_size=3000),
    ts_producer=i64_edges,
    ts_broker=i64_edges,
    uid=uids,
    vbucket=st.integers(0, 1023) | u16,
    epoch=u64,
    offset=u64,
)


@st.composite
def vbucket_maps(draw: st.DrawFn) -> VBucketMap:
    nodes = draw(st.lists(st.builds(NodeInfo, texts, texts, u16, u16), min_size=1, max_size=3))
    if draw(st.booleans()):
        return VBucketMap.single_node(nodes[0]._replace(workers=max(1, nodes[0].workers % 64)), draw(u64))
    rng = random.Random(draw(st.integers(0, 2**32)))
    owners = tuple((rng.randrange(len(nodes)), rng.randrange(2**16)) for _ in range(VBUCKETS))
    incoming = None
    if draw(st.booleans()):  # vbuckets moving: some have an incoming owner
        incoming = tuple(
            (rng.randrange(len(nodes)), rng.randrange(2**16)) if rng.random() < 0.3 else NO_OWNER
            for _ in range(VBUCKETS)
        )
    return VBucketMap(draw(u64), tuple(nodes), owners, incoming)


welcomes = st.builds(
    Welcome,
    node_id=texts,
    worker=u16,
    map=vbucket_maps(),
    max_frame_bytes=u32,
    max_pending_bytes=u64,
    connection_id=u64,
    server_version=st.none() | texts,
    protocol_version=u16,
    resumed=st.none() | st.builds(Resumed, u64, u64, u64),
    resume_token=st.none() | st.binary(min_size=RESUME_TOKEN_BYTES, max_size=RESUME_TOKEN_BYTES),
)


_Seq = TypeVar("_Seq", bytes, str)


def _pattern(seed: _Seq, n: int) -> _Seq:
    """n bytes (or characters) repeating seed: cheap to make at any size, still not all equal."""
    return (seed * (n // len(seed) + 1))[:n]


@st.composite
def large_messages(draw: st.DrawFn, limit: int = DEFAULT_MAX_FRAME_BYTES - 256) -> Message:
    """Messages whose three vectors together take up to `limit` bytes (pattern bytes).

    With the default limit the canonical frame, and a Builder's, fit the default
    maximum frame size.
    """
    total = draw(st.integers(0, limit) | st.sampled_from([limit, limit - 1, limit // 2]))
    kp_len = draw(st.integers(0, total) | st.integers(0, min(64, total)))
    key_len = draw(st.integers(0, total - kp_len) | st.integers(0, min(64, total - kp_len)))
    seeds = draw(st.lists(st.binary(min_size=1, max_size=7), min_size=3, max_size=3))
    return Message(
        _pattern(seeds[0], kp_len),
        _pattern(seeds[1], key_len),
        _pattern(seeds[2], total - kp_len - key_len),
        draw(i64_edges),
        draw(i64_edges),
        draw(uids),
    )


positions = st.builds(Position, u16, u64, u64)


i32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def subscribes(draw: st.DrawFn) -> Subscribe:
    """Subscribes of every version: version 3's fields are all left out (None, 0, empty) half
    of the time, so that plain subscriptions, groups without acks and members with every
    setting all come up; group and dead_letter are absent, empty or set."""
    sub = Subscribe(
        draw(u32),
        draw(st.binary(max_size=100)),
        draw(st.none() | st.binary(max_size=40)),
        draw(st.lists(positions, max_size=5).map(tuple)),
        draw(i64),
        draw(u32),
    )
    if draw(st.booleans()):
        return sub
    return sub._replace(
        group=draw(st.none() | texts),
        key_shared=draw(st.booleans()),
        ack=draw(st.booleans()),
        ack_wait_ms=draw(u32),
        max_deliveries=draw(u32),
        backoff_ms=tuple(draw(st.lists(u32, max_size=6))),
        max_in_flight=draw(u32),
        max_in_flight_bytes=draw(u64),
        dead_letter=draw(st.none() | st.binary(max_size=40)),
        drain_timeout_ms=draw(u32),
    )


acks = st.builds(
    Ack,
    u32,
    st.sampled_from([AckKind.ACK, AckKind.NACK, AckKind.IN_PROGRESS]) | u8,
    st.lists(positions, max_size=6).map(tuple),
    st.just(-1) | i32,  # -1, the default, is not written
)


group_notices = st.builds(
    GroupNotice,
    u32,
    st.sampled_from([GroupEvent.PAUSED, GroupEvent.RESUMED, GroupEvent.DRAIN_EXPIRED]) | u8,
    u64,
    u16,
)


deliveries = st.builds(Delivery, u32, u32, st.just(1) | u32)


previous_connections = st.builds(PreviousConnection, u64, u64, u64, st.none() | st.binary(max_size=40), u64)


control_frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(
        Hello,
        u16,
        i16,
        st.none() | texts,
        st.none() | texts,
        st.none() | st.builds(PreviousConnection, u64, u64, u64, st.none(), u64),
        st.booleans(),
        st.booleans(),
    ),
    subscribes(),
    st.builds(Unsubscribe, u32),
    st.just(Pause()),
    st.just(Resume()),
    st.builds(Ping, u64),
    st.builds(Pong, u64, i64, u64),
    st.builds(
        Error, u16, st.none() | texts, u64, st.booleans(), u32, st.none() | st.binary(max_size=300), u32
    ),
    st.builds(LossNotice, u64, u8, u32, st.none() | positions, st.none() | positions),
    st.builds(Replay, u32, u32, i64, u32),
    st.builds(Goodbye, st.none() | texts, u64),
    st.builds(MapApplied, u64),
    st.builds(
        Read,
        u32,
        st.binary(max_size=100),
        st.none() | st.binary(max_size=40),
        st.lists(positions, max_size=5).map(tuple),
        i64,
        st.lists(positions, max_size=5).map(tuple),
        st.lists(u16, max_size=8).map(tuple),  # any u16, unchecked by the codec (the server refuses)
    ),
    st.builds(ReadDone, u32, u16, u64, u64, u64, st.booleans(), u16, st.booleans()),
    deliveries,
    acks,
    group_notices,
)


small_frames: st.SearchStrategy[Frame] = messages | control_frames


@st.composite
def large_control_frames(draw: st.DrawFn, limit: int = DEFAULT_MAX_FRAME_BYTES - 256) -> Frame:
    """Control frames whose vectors or strings take up to `limit` bytes (patterns)."""
    n = draw(st.integers(0, limit) | st.just(limit))
    cut = draw(st.integers(0, n))
    seed = draw(st.binary(min_size=1, max_size=7))
    text = _pattern(draw(st.text(min_size=1, max_size=3)), n // 4)  # up to 4 UTF-8 bytes a character
    choices: list[Frame] = [
        Subscribe(draw(u32), _pattern(seed, cut), _pattern(seed[::-1], n - cut)),
        Hello(1, -1, text[: len(text) // 2], text[len(text) // 2 :]),
        Error(
            draw(u16),
            text[: len(text) // 2],
            draw(u64),
            draw(st.booleans()),
            draw(u32),
            _pattern(seed, n // 2),
        ),
        Goodbye(text),
        # Version 3: a group member with a long name, dead-letter key and backoff schedule
        # (at most n/4 + n/8 + n/4 + n/8 bytes), and an Ack of many positions (n/2 bytes).
        Subscribe(
            draw(u32),
            _pattern(seed, n // 8 + 1),
            group=text[: len(text) // 4],
            ack=True,
            backoff_ms=tuple(range(n // 32)),
            dead_letter=_pattern(seed[::-1], n // 4),
        ),
        Ack(draw(u32), AckKind.ACK, tuple(Position(i % VBUCKETS, i, i + 1) for i in range(n // 48))),
    ]
    return draw(st.sampled_from(choices))


map_updates = st.builds(MapUpdate, vbucket_maps())


# Every kind of frame, Welcome and MapUpdate (a 1024-entry map, a few KiB, slower to make) included.
all_frames: st.SearchStrategy[Frame] = small_frames | welcomes | map_updates


def _vec(tab: Any, vt_offset: int) -> bytes | None:
    """A byte vector through the flatbuffers runtime Table the accessors use."""
    o = tab.Offset(vt_offset)
    if not o:
        return None
    start = tab.Vector(o)
    return bytes(tab.Bytes[start : start + tab.VectorLen(o)])


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode("utf-8")


def _read_message(m: Any) -> Message:
    kp, key, payload = _vec(m._tab, 4), _vec(m._tab, 6), _vec(m._tab, 8)
    assert kp is not None and key is not None and payload is not None
    # The per-element accessors agree with the slices (first and last byte).
    for accessor, length, vec in (
        (m.KeyPartition, m.KeyPartitionLength(), kp),
        (m.Key, m.KeyLength(), key),
        (m.Payload, m.PayloadLength(), payload),
    ):
        assert length == len(vec)
        if vec:
            assert accessor(0) == vec[0] and accessor(length - 1) == vec[-1]
    stamps, uid = m.Stamps(), m.Uid()
    assert stamps is not None
    return Message(
        kp,
        key,
        payload,
        stamps.TsProducer(),
        stamps.TsBroker(),
        None if uid is None else bytes(uid.Bytes()),
        stamps.Vbucket(),
        stamps.Epoch(),
        stamps.Offset(),
    )


def _read_map(vm: Any) -> VBucketMap:
    nodes = []
    for i in range(vm.NodesLength()):
        n = vm.Nodes(i)
        nodes.append(NodeInfo(_text(n.NodeId()) or "", _text(n.Host()) or "", n.Port(), n.Workers()))
    owners = []
    for i in range(vm.OwnersLength()):
        o = vm.Owners(i)
        owners.append((o.Node(), o.Worker()))
    incoming = None
    if not vm.IncomingIsNone():
        incoming = tuple((vm.Incoming(i).Node(), vm.Incoming(i).Worker()) for i in range(vm.IncomingLength()))
    return VBucketMap(vm.Version(), tuple(nodes), tuple(owners), incoming)


def generated_read(frame: bytes) -> Frame:
    """Decode a whole size-prefixed frame with the generated accessors only."""
    assert struct.unpack_from("<I", frame)[0] == len(frame) - 4
    assert fbs.Frame.FrameBufferHasIdentifier(frame, 0, size_prefixed=True)
    root = fbs.Frame.GetRootAs(frame, 4)
    kind, tab = root.BodyType(), root.Body()
    assert tab is not None

    def body(cls: Any) -> Any:
        obj = cls()
        obj.Init(tab.Bytes, tab.Pos)
        return obj

    if kind == Body.Message:
        return _read_message(body(fbs.Message))
    if kind == Body.Hello:
        h = body(fbs.Hello)
        p = h.Previous()
        previous = (
            None
            if p is None
            else PreviousConnection(
                p.ConnectionId(), p.Received(), p.ToldLost(), _vec(p._tab, 10), p.GroupReceived()
            )
        )
        return Hello(
            h.ProtocolVersion(),
            h.Worker(),
            _text(h.ClientName()),
            _text(h.AuthToken()),
            previous,
            h.Positions(),
            h.Tls(),
        )
    if kind == Body.Welcome:
        w = body(fbs.Welcome)
        return Welcome(
            _text(w.NodeId()) or "",
            w.Worker(),
            _read_map(w.Map()),
            w.MaxFrameBytes(),
            w.MaxPendingBytes(),
            w.ConnectionId(),
            _text(w.ServerVersion()),
            w.ProtocolVersion(),
            None
            if w.Resumed() is None
            else Resumed(w.Resumed().ConnectionId(), w.Resumed().Processed(), w.Resumed().Refused()),
            _vec(w._tab, 22),
        )
    if kind == Body.Subscribe:
        s = body(fbs.Subscribe)
        assert s.PatternLength() == len(_vec(s._tab, 6) or b"")
        since = tuple(
            Position(s.Since(i).Vbucket(), s.Since(i).Epoch(), s.Since(i).Offset())
            for i in range(s.SinceLength())
        )
        assert s.BackoffMsIsNone() == (_vec(s._tab, 26) is None)
        assert s.DeadLetterLength() == len(_vec(s._tab, 32) or b"")
        return Subscribe(
            s.Sid(),
            _vec(s._tab, 6) or b"",
            _vec(s._tab, 8),
            since,
            s.SinceTime(),
            s.Last(),
            _text(s.Group()),
            s.KeyShared(),
            s.Ack(),
            s.AckWaitMs(),
            s.MaxDeliveries(),
            tuple(s.BackoffMs(i) for i in range(s.BackoffMsLength())),
            s.MaxInFlight(),
            s.MaxInFlightBytes(),
            _vec(s._tab, 32),
            s.DrainTimeoutMs(),
        )
    if kind == Body.Unsubscribe:
        return Unsubscribe(body(fbs.Unsubscribe).Sid())
    if kind == Body.Pause:
        return Pause()
    if kind == Body.Resume:
        return Resume()
    if kind == Body.Ping:
        return Ping(body(fbs.Ping).Id())
    if kind == Body.Pong:
        pong = body(fbs.Pong)
        return Pong(pong.Id(), pong.Ts(), pong.Behind())
    if kind == Body.Error:
        e = body(fbs.Error)
        assert e.RefusedLength() == len(_vec(e._tab, 14) or b"")
        return Error(
            e.Code(), _text(e.Message()), e.MapVersion(), e.Fatal(), e.Sid(), _vec(e._tab, 14), e.Rid()
        )
    if kind == Body.LossNotice:
        n = body(fbs.LossNotice)
        at = n.At()
        through = n.Through()
        return LossNotice(
            n.Dropped(),
            n.Reason(),
            n.Sid(),
            None if at is None else Position(at.Vbucket(), at.Epoch(), at.Offset()),
            None if through is None else Position(through.Vbucket(), through.Epoch(), through.Offset()),
        )
    if kind == Body.Replay:
        r = body(fbs.Replay)
        return Replay(r.Sid(), r.Messages(), r.Ts(), r.Rid())
    if kind == Body.Goodbye:
        g = body(fbs.Goodbye)
        return Goodbye(_text(g.Reason()), g.Processed())
    if kind == Body.MapUpdate:
        return MapUpdate(_read_map(body(fbs.MapUpdate).Map()))
    if kind == Body.MapApplied:
        return MapApplied(body(fbs.MapApplied).Version())
    if kind == Body.Read:
        r = body(fbs.Read)
        start = tuple(
            Position(r.Start(i).Vbucket(), r.Start(i).Epoch(), r.Start(i).Offset())
            for i in range(r.StartLength())
        )
        stop = tuple(
            Position(r.Stop(i).Vbucket(), r.Stop(i).Epoch(), r.Stop(i).Offset())
            for i in range(r.StopLength())
        )
        vbuckets = tuple(r.Vbuckets(i) for i in range(r.VbucketsLength()))
        return Read(r.Rid(), _vec(r._tab, 6) or b"", _vec(r._tab, 8), start, r.StartTime(), stop, vbuckets)
    if kind == Body.ReadDone:
        d = body(fbs.ReadDone)
        return ReadDone(
            d.Rid(), d.Vbucket(), d.Epoch(), d.Next(), d.Evicted(), d.EpochChanged(), d.Remaining(), d.Moved()
        )
    if kind == Body.Delivery:
        d = body(fbs.Delivery)
        return Delivery(d.Sid(), d.Messages(), d.Attempt())
    if kind == Body.Ack:
        a = body(fbs.Ack)
        acked = tuple(
            Position(a.Positions(i).Vbucket(), a.Positions(i).Epoch(), a.Positions(i).Offset())
            for i in range(a.PositionsLength())
        )
        return Ack(a.Sid(), a.Kind(), acked, a.DelayMs())
    if kind == Body.GroupNotice:
        n = body(fbs.GroupNotice)
        return GroupNotice(n.Sid(), n.Event(), n.Messages(), n.Vbucket())
    raise AssertionError(f"unknown body type {kind}")


BODY_TYPES: dict[type, int] = {
    Message: Body.Message,
    Hello: Body.Hello,
    Welcome: Body.Welcome,
    Subscribe: Body.Subscribe,
    Unsubscribe: Body.Unsubscribe,
    Pause: Body.Pause,
    Resume: Body.Resume,
    Ping: Body.Ping,
    Pong: Body.Pong,
    Error: Body.Error,
    LossNotice: Body.LossNotice,
    Goodbye: Body.Goodbye,
    MapUpdate: Body.MapUpdate,
    MapApplied: Body.MapApplied,
    Read: Body.Read,
    ReadDone: Body.ReadDone,
    Replay: Body.Replay,
    Delivery: Body.Delivery,
    Ack: Body.Ack,
    GroupNotice: Body.GroupNotice,
}


class Writer:
    """Writes one frame with flatbuffers.Builder, every free choice drawn by hypothesis."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.b = flatbuffers.Builder(draw(st.integers(0, 300)))
        self.b.ForceDefaults(draw(st.booleans()))

    def junk(self) -> None:
        """Maybe write bytes nothing refers to, which shifts every later offset."""
        if self.draw(st.booleans()):
            self.b.CreateByteVector(self.draw(st.binary(max_size=11)))

    def refs(self, values: dict[str, bytes | str | None]) -> dict[str, int]:
        """Create the vectors/strings of one table in a drawn order."""
        out: dict[str, int] = {}
        for name in self.draw(st.permutations(sorted(values))):
            value = values[name]
            if value is None:
                continue
            self.junk()
            out[name] = (
                self.b.CreateString(value) if isinstance(value, str) else self.b.CreateByteVector(value)
            )
        return out

    def positions(self, start_vector: Callable[[Any, int], Any], at: tuple[Position, ...]) -> int | None:
        """A vector of Position structs, or None (drawn: an empty vector or none at all)."""
        if not at and self.draw(st.booleans()):
            return None
        self.junk()
        start_vector(self.b, len(at))
        for p in reversed(at):
            fbs.CreatePosition(self.b, p.epoch, p.offset, p.vbucket)
        return int(self.b.EndVector())

    def u16s(self, start_vector: Callable[[Any, int], Any], values: tuple[int, ...]) -> int | None:
        """A vector of ushort, or None (drawn: an empty vector or none at all)."""
        if not values and self.draw(st.booleans()):
            return None
        self.junk()
        start_vector(self.b, len(values))
        for v in reversed(values):
            self.b.PrependUint16(v)
        return int(self.b.EndVector())

    def u32s(self, start_vector: Callable[[Any, int], Any], values: tuple[int, ...]) -> int | None:
        """A vector of uint, or None (drawn: an empty vector or none at all)."""
        if not values and self.draw(st.booleans()):
            return None
        self.junk()
        start_vector(self.b, len(values))
        for v in reversed(values):
            self.b.PrependUint32(v)
        return int(self.b.EndVector())

    def table(
        self, start: Callable[[Any], None], end: Callable[[Any], int], adders: list[Callable[[], None]]
    ) -> int:
        start(self.b)
        for add in self.draw(st.permutations(adders)):
            add()
        return end(self.b)

    def node(self, node: NodeInfo) -> int:
        r = self.refs({"id": node.node_id, "host": node.host})
        b = self.b
        return self.table(
            fbs.NodeStart,
            fbs.NodeEnd,
            [
                lambda: fbs.NodeAddNodeId(b, r["id"]),
                lambda: fbs.NodeAddHost(b, r["host"]),
                lambda: fbs.NodeAddPort(b, node.port),
                lambda: fbs.NodeAddWorkers(b, node.workers),
            ],
        )

    def vmap(self, vmap: VBucketMap) -> int:
        b = self.b
        nodes = [self.node(n) for n in vmap.nodes]
        fbs.VBucketMapStartNodesVector(b, len(nodes))
        for off in reversed(nodes):
            b.PrependUOffsetTRelative(off)
        nodes_vec = b.EndVector()
        self.junk()
        fbs.VBucketMapStartOwnersVector(b, len(vmap.owners))
        for node_index, worker in reversed(vmap.owners):
            fbs.CreateVBucketOwner(b, node_index, worker)
        owners_vec = b.EndVector()
        adders = [
            lambda: fbs.VBucketMapAddVersion(b, vmap.version),
            lambda: fbs.VBucketMapAddNodes(b, nodes_vec),
            lambda: fbs.VBucketMapAddOwners(b, owners_vec),
        ]
        if vmap.incoming is not None:
            self.junk()
            fbs.VBucketMapStartIncomingVector(b, len(vmap.incoming))
            for node_index, worker in reversed(vmap.incoming):
                fbs.CreateVBucketOwner(b, node_index, worker)
            incoming_vec = b.EndVector()
            adders.append(lambda: fbs.VBucketMapAddIncoming(b, incoming_vec))
        return self.table(fbs.VBucketMapStart, fbs.VBucketMapEnd, adders)

    def body(self, frame: Frame) -> int:
        b = self.b
        adders: list[Callable[[], None]]
        if isinstance(frame, Message):
            r = self.refs({"kp": frame.key_partition, "key": frame.key, "payload": frame.payload})
            adders = [
                lambda: fbs.MessageAddKeyPartition(b, r["kp"]),
                lambda: fbs.MessageAddKey(b, r["key"]),
                lambda: fbs.MessageAddPayload(b, r["payload"]),
                # Structs are written inline, right before their slot.
                lambda: fbs.MessageAddStamps(
                    b,
                    fbs.CreateStamps(
                        b, frame.ts_producer, frame.ts_broker, frame.epoch, frame.offset, frame.vbucket
                    ),
                ),
            ]
            if frame.uid is not None:
                uid = frame.uid
                adders.append(lambda: fbs.MessageAddUid(b, fbs.CreateKsuid(b, uid)))
            return self.table(fbs.MessageStart, fbs.MessageEnd, adders)
        if isinstance(frame, Hello):
            previous = frame.previous
            prev = 0
            if previous is not None:
                proof = self.refs({"proof": previous.resume_token})
                prev_adders = [
                    lambda: fbs.PreviousConnectionAddConnectionId(b, previous.connection_id),
                    lambda: fbs.PreviousConnectionAddReceived(b, previous.received),
                    lambda: fbs.PreviousConnectionAddToldLost(b, previous.told_lost),
                    lambda: fbs.PreviousConnectionAddGroupReceived(b, previous.group_received),
                ]
                if "proof" in proof:
                    prev_adders.append(lambda: fbs.PreviousConnectionAddResumeToken(b, proof["proof"]))
                prev = self.table(fbs.PreviousConnectionStart, fbs.PreviousConnectionEnd, prev_adders)
            r = self.refs({"name": frame.client_name, "token": frame.auth_token})
            adders = [
                lambda: fbs.HelloAddProtocolVersion(b, frame.protocol_version),
                lambda: fbs.HelloAddWorker(b, frame.worker),
            ]
            if previous is not None:
                adders.append(lambda: fbs.HelloAddPrevious(b, prev))
            if "name" in r:
                adders.append(lambda: fbs.HelloAddClientName(b, r["name"]))
            if "token" in r:
                adders.append(lambda: fbs.HelloAddAuthToken(b, r["token"]))
            if frame.positions or self.draw(st.booleans()):
                adders.append(lambda: fbs.HelloAddPositions(b, frame.positions))
            if frame.tls or self.draw(st.booleans()):
                adders.append(lambda: fbs.HelloAddTls(b, frame.tls))
            return self.table(fbs.HelloStart, fbs.HelloEnd, adders)
        if isinstance(frame, Welcome):
            vmap = self.vmap(frame.map)
            resumed = frame.resumed
            res = 0
            if resumed is not None:
                res = self.table(
                    fbs.ResumedStart,
                    fbs.ResumedEnd,
                    [
                        lambda: fbs.ResumedAddConnectionId(b, resumed.connection_id),
                        lambda: fbs.ResumedAddProcessed(b, resumed.processed),
                        lambda: fbs.ResumedAddRefused(b, resumed.refused),
                    ],
                )
            r = self.refs(
                {"node_id": frame.node_id, "version": frame.server_version, "proof": frame.resume_token}
            )
            adders = [
                lambda: fbs.WelcomeAddProtocolVersion(b, frame.protocol_version),
                lambda: fbs.WelcomeAddNodeId(b, r["node_id"]),
                lambda: fbs.WelcomeAddWorker(b, frame.worker),
                lambda: fbs.WelcomeAddMap(b, vmap),
                lambda: fbs.WelcomeAddMaxFrameBytes(b, frame.max_frame_bytes),
                lambda: fbs.WelcomeAddMaxPendingBytes(b, frame.max_pending_bytes),
                lambda: fbs.WelcomeAddConnectionId(b, frame.connection_id),
            ]
            if "version" in r:
                adders.append(lambda: fbs.WelcomeAddServerVersion(b, r["version"]))
            if resumed is not None:
                adders.append(lambda: fbs.WelcomeAddResumed(b, res))
            if "proof" in r:
                adders.append(lambda: fbs.WelcomeAddResumeToken(b, r["proof"]))
            return self.table(fbs.WelcomeStart, fbs.WelcomeEnd, adders)
        if isinstance(frame, Subscribe):
            since = self.positions(fbs.SubscribeStartSinceVector, frame.since)
            backoff = self.u32s(fbs.SubscribeStartBackoffMsVector, frame.backoff_ms)
            r = self.refs(
                {
                    "pattern": frame.pattern,
                    "kp": frame.key_partition,
                    "group": frame.group,
                    "dead_letter": frame.dead_letter,
                }
            )
            adders = [
                lambda: fbs.SubscribeAddSid(b, frame.sid),
                lambda: fbs.SubscribeAddPattern(b, r["pattern"]),
                lambda: fbs.SubscribeAddSinceTime(b, frame.since_time),
                lambda: fbs.SubscribeAddLast(b, frame.last),
                lambda: fbs.SubscribeAddKeyShared(b, frame.key_shared),
                lambda: fbs.SubscribeAddAck(b, frame.ack),
                lambda: fbs.SubscribeAddAckWaitMs(b, frame.ack_wait_ms),
                lambda: fbs.SubscribeAddMaxDeliveries(b, frame.max_deliveries),
                lambda: fbs.SubscribeAddMaxInFlight(b, frame.max_in_flight),
                lambda: fbs.SubscribeAddMaxInFlightBytes(b, frame.max_in_flight_bytes),
                lambda: fbs.SubscribeAddDrainTimeoutMs(b, frame.drain_timeout_ms),
            ]
            if "kp" in r:
                adders.append(lambda: fbs.SubscribeAddKeyPartition(b, r["kp"]))
            if since is not None:
                adders.append(lambda: fbs.SubscribeAddSince(b, since))
            if "group" in r:
                adders.append(lambda: fbs.SubscribeAddGroup(b, r["group"]))
            if backoff is not None:
                adders.append(lambda: fbs.SubscribeAddBackoffMs(b, backoff))
            if "dead_letter" in r:
                adders.append(lambda: fbs.SubscribeAddDeadLetter(b, r["dead_letter"]))
            return self.table(fbs.SubscribeStart, fbs.SubscribeEnd, adders)
        if isinstance(frame, Delivery):
            return self.table(
                fbs.DeliveryStart,
                fbs.DeliveryEnd,
                [
                    lambda: fbs.DeliveryAddSid(b, frame.sid),
                    lambda: fbs.DeliveryAddMessages(b, frame.messages),
                    lambda: fbs.DeliveryAddAttempt(b, frame.attempt),
                ],
            )
        if isinstance(frame, Ack):
            acked = self.positions(fbs.AckStartPositionsVector, frame.positions)
            adders = [
                lambda: fbs.AckAddSid(b, frame.sid),
                lambda: fbs.AckAddKind(b, frame.kind),
                # -1 is the default: left out unless ForceDefaults was drawn.
                lambda: fbs.AckAddDelayMs(b, frame.delay_ms),
            ]
            if acked is not None:
                adders.append(lambda: fbs.AckAddPositions(b, acked))
            return self.table(fbs.AckStart, fbs.AckEnd, adders)
        if isinstance(frame, GroupNotice):
            return self.table(
                fbs.GroupNoticeStart,
                fbs.GroupNoticeEnd,
                [
                    lambda: fbs.GroupNoticeAddSid(b, frame.sid),
                    lambda: fbs.GroupNoticeAddEvent(b, frame.event),
                    lambda: fbs.GroupNoticeAddMessages(b, frame.messages),
                    lambda: fbs.GroupNoticeAddVbucket(b, frame.vbucket),
                ],
            )
        if isinstance(frame, Read):
            start = self.positions(fbs.ReadStartStartVector, frame.start)
            stop = self.positions(fbs.ReadStartStopVector, frame.stop)
            vbuckets = self.u16s(fbs.ReadStartVbucketsVector, frame.vbuckets)
            r = self.refs({"pattern": frame.pattern, "kp": frame.key_partition})
            adders = [
                lambda: fbs.ReadAddRid(b, frame.rid),
                lambda: fbs.ReadAddPattern(b, r["pattern"]),
                lambda: fbs.ReadAddStartTime(b, frame.start_time),
            ]
            if "kp" in r:
                adders.append(lambda: fbs.ReadAddKeyPartition(b, r["kp"]))
            if start is not None:
                adders.append(lambda: fbs.ReadAddStart(b, start))
            if stop is not None:
                adders.append(lambda: fbs.ReadAddStop(b, stop))
            if vbuckets is not None:
                adders.append(lambda: fbs.ReadAddVbuckets(b, vbuckets))
            return self.table(fbs.ReadStart, fbs.ReadEnd, adders)
        if isinstance(frame, ReadDone):
            return self.table(
                fbs.ReadDoneStart,
                fbs.ReadDoneEnd,
                [
                    lambda: fbs.ReadDoneAddRid(b, frame.rid),
                    lambda: fbs.ReadDoneAddVbucket(b, frame.vbucket),
                    lambda: fbs.ReadDoneAddEpoch(b, frame.epoch),
                    lambda: fbs.ReadDoneAddNext(b, frame.next),
                    lambda: fbs.ReadDoneAddEvicted(b, frame.evicted),
                    lambda: fbs.ReadDoneAddEpochChanged(b, frame.epoch_changed),
                    lambda: fbs.ReadDoneAddRemaining(b, frame.remaining),
                    lambda: fbs.ReadDoneAddMoved(b, frame.moved),
                ],
            )
        if isinstance(frame, Unsubscribe):
            return self.table(
                fbs.UnsubscribeStart, fbs.UnsubscribeEnd, [lambda: fbs.UnsubscribeAddSid(b, frame.sid)]
            )
        if isinstance(frame, Pause):
            return self.table(fbs.PauseStart, fbs.PauseEnd, [])
        if isinstance(frame, Resume):
            return self.table(fbs.ResumeStart, fbs.ResumeEnd, [])
        if isinstance(frame, Ping):
            return self.table(fbs.PingStart, fbs.PingEnd, [lambda: fbs.PingAddId(b, frame.id)])
        if isinstance(frame, Pong):
            return self.table(
                fbs.PongStart,
                fbs.PongEnd,
                [
                    lambda: fbs.PongAddId(b, frame.id),
                    lambda: fbs.PongAddTs(b, frame.ts),
                    lambda: fbs.PongAddBehind(b, frame.behind),
                ],
            )
        if isinstance(frame, Error):
            r = self.refs({"message": frame.message, "refused": frame.refused})
            adders = [
                lambda: fbs.ErrorAddCode(b, frame.code),
                lambda: fbs.ErrorAddMapVersion(b, frame.map_version),
                lambda: fbs.ErrorAddFatal(b, frame.fatal),
                lambda: fbs.ErrorAddSid(b, frame.sid),
                lambda: fbs.ErrorAddRid(b, frame.rid),
            ]
            if "message" in r:
                adders.append(lambda: fbs.ErrorAddMessage(b, r["message"]))
            if "refused" in r:
                adders.append(lambda: fbs.ErrorAddRefused(b, r["refused"]))
            return self.table(fbs.ErrorStart, fbs.ErrorEnd, adders)
        if isinstance(frame, LossNotice):
            return self.table(
                fbs.LossNoticeStart,
                fbs.LossNoticeEnd,
                [
                    lambda: fbs.LossNoticeAddDropped(b, frame.dropped),
                    lambda: fbs.LossNoticeAddReason(b, frame.reason),
                    lambda: fbs.LossNoticeAddSid(b, frame.sid),
                ]
                + (
                    []
                    if frame.at is None
                    else [
                        lambda: fbs.LossNoticeAddAt(
                            b,
                            fbs.CreatePosition(b, frame.at.epoch, frame.at.offset, frame.at.vbucket),  # type: ignore[union-attr]
                        )
                    ]
                )
                + (
                    []
                    if frame.through is None
                    else [
                        lambda: fbs.LossNoticeAddThrough(
                            b,
                            fbs.CreatePosition(
                                b,
                                frame.through.epoch,  # type: ignore[union-attr]
                                frame.through.offset,  # type: ignore[union-attr]
                                frame.through.vbucket,  # type: ignore[union-attr]
                            ),
                        )
                    ]
                ),
            )
        if isinstance(frame, Replay):
            return self.table(
                fbs.ReplayStart,
                fbs.ReplayEnd,
                [
                    lambda: fbs.ReplayAddSid(b, frame.sid),
                    lambda: fbs.ReplayAddRid(b, frame.rid),
                    lambda: fbs.ReplayAddMessages(b, frame.messages),
                    lambda: fbs.ReplayAddTs(b, frame.ts),
                ],
            )
        if isinstance(frame, MapUpdate):
            vmap = self.vmap(frame.map)
            return self.table(fbs.MapUpdateStart, fbs.MapUpdateEnd, [lambda: fbs.MapUpdateAddMap(b, vmap)])
        if isinstance(frame, MapApplied):
            return self.table(
                fbs.MapAppliedStart, fbs.MapAppliedEnd, [lambda: fbs.MapAppliedAddVersion(b, frame.version)]
            )
        if isinstance(frame, Goodbye):
            r = self.refs({"reason": frame.reason})
            adders = [lambda: fbs.GoodbyeAddProcessed(b, frame.processed)]
            if "reason" in r:
                adders.append(lambda: fbs.GoodbyeAddReason(b, r["reason"]))
            return self.table(fbs.GoodbyeStart, fbs.GoodbyeEnd, adders)
        raise AssertionError(frame)

    def frame(self, frame: Frame) -> bytes:
        body = self.body(frame)
        self.junk()
        b = self.b
        root = self.table(
            fbs.FrameStart,
            fbs.FrameEnd,
            [lambda: fbs.FrameAddBodyType(b, BODY_TYPES[type(frame)]), lambda: fbs.FrameAddBody(b, body)],
        )
        b.FinishSizePrefixed(root, b"BRKY")
        return bytes(b.Output())


@st.composite
def builder_frames(draw: st.DrawFn, frames: st.SearchStrategy[Frame]) -> tuple[Frame, bytes]:
    """(value, the frame written by flatbuffers.Builder with drawn choices)."""
    frame = draw(frames)
    return frame, Writer(draw).frame(frame)


@st.composite
def encoded_frames(draw: st.DrawFn, frames: st.SearchStrategy[Frame] = small_frames) -> tuple[Frame, bytes]:
    """(value, its bytes from the codec or from the Builder)."""
    frame = draw(frames)
    if draw(st.booleans()):
        return frame, encode_frame(frame)
    return frame, Writer(draw).frame(frame)


E = 0x5EED5EED5EED5EED


# One value of each frame type (the doc tests and the route tests use them too).
ONE_OF_EACH: list[Frame] = [
    Message(b"t1", b"orders.eu", b"hello", 1, 2, None, 828, E, 42),
    Hello(),
    Welcome("n", 0, VBucketMap.single_node(NodeInfo("n", "h", 4777, 2)), 1 << 20, 64 << 20),
    Subscribe(1, b"orders.>", group="billing", key_shared=True, ack=True, backoff_ms=(10, 20)),
    Unsubscribe(1),
    Pause(),
    Resume(),
    Ping(1),
    Pong(1, 2),
    Error(23, "bad group", 1, False, 1),
    LossNotice(1, 9, 1, Position(828, E, 7)),
    Goodbye("bye", 3),
    MapUpdate(VBucketMap.single_node(NodeInfo("n", "h", 4777, 2), 2)),
    MapApplied(2),
    Read(1, b">"),
    ReadDone(1, 828, E, 43),
    Replay(1, 2, 3),
    Delivery(1, 2),
    Ack(1, AckKind.NACK, (Position(828, E, 7),), 500),
    GroupNotice(1, GroupEvent.DRAIN_EXPIRED, 3, 828),
]
