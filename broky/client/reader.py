"""Bounded reads in the SDK: `Client.read` and `Client.positions` (schema/README.md 5.2).

A bounded read returns the retained messages of a closed range, per vbucket,
and where each vbucket's range ended (`RangeEnd`: its epoch, the next offset,
how many of its offsets were evicted before they could be read, whether its
start named an epoch that is gone), then stops: nothing live. Two reads of
the same range return the same messages while they are retained, so a
consumer can read from positions it committed to positions it fixed
beforehand (the Spark source's micro-batches) and read again after a
failure.

Theory of operation
-------------------
Connections. A read asks every worker that owns vbuckets of it, per the
client's map, on a connection of its own, opened for the read
(`open_connection` with Hello.worker, as a Link opens its connections) and
closed after it. The Links that carry publishes and subscriptions are not
involved: a read neither waits behind their traffic nor holds it up, and a
cut read connection needs no resume. On each: Read{rid 1, pattern,
key_partition, start, start_time, stop, vbuckets}, with every position the
caller gave (each worker takes its own, so a map older than the worker's
loses no position) and, as `vbuckets`, exactly the vbuckets asked of that
worker in that round (one Read encoded per worker), then Replay{rid, n} and
n Message frames, and a ReadDone per vbucket, the last with `remaining` 0.

Coverage. The read covers every vbucket, or the caller's `vbuckets`, or the
partition's vbucket (if among `vbuckets`), and expects one ReadDone for
each. Each worker is asked for the vbuckets the map gives it of those, and
its Read names them: it answers for no other, even one it owns that the
map gives elsewhere (a move in between), and it leaves out the ones it no
longer owns. Only the asked ones are taken from its answer too (a server
that predates Read.vbuckets reads all it owns), so a message never comes
twice. A
vbucket that no worker answered for (it moved during the read; a worker
that said NOT_MY_VBUCKET) is asked of its owner per the newest map seen
(every Welcome carries the map) in the next round, at most MAX_ROUNDS; a
vbucket ends once, so a message is never returned twice.

Moves. A planned move hands a vbucket's sequence to its new owner at offset
H; the old owner keeps what it retained of the vbucket and answers a Read
that names it (schema/README.md 5.2) up to H - 1, with `ReadDone.moved`.
`via` names, per vbucket, the worker to ask first (the owner when `start`
was taken, with its address: a drained node is no longer in the map, and
lingers a few seconds after its drain). A moved ReadDone whose range ends
before the read's `stop` (or without one) does not end the vbucket: its
start moves on to (epoch, H - 1), what it counted as evicted is carried, and
the next round asks the owner per the newest map for the rest, so the
vbucket's messages still come in offset order. A `via` worker that cannot
be reached is skipped: its vbuckets go to the next round like any unanswered.

The caller's side. `client.read(...)` returns a `Reading`: awaited, it gives
a `ReadResult` (every message, by vbucket then offset, and the ends);
iterated (`async for`), it gives the messages as they come (in offset order
per vbucket; the workers' answers interleave), and `reading.ends` once done. Messages wait
in one queue: when it holds more than max_pending_msgs, the read connections
stop reading (`pause_reading`) until it is down to half, and the server,
which sends a read only as fast as the connection drains, waits with them.
Leaving the loop early (or `await reading.close()`) closes the connections.

In bulk. `reading.batches(decoder)` gives the messages decoded by the
caller's `BulkDecoder` instead, a batch at a time, with no Message made per
message (the Spark source's Arrow columns, broky.spark.readcols): each read
connection hands the bytes it receives to `decoder.scan` (its `on_run`,
broky.client.connection), which takes the runs of Message frames, those of
the vbuckets still asked of that worker (a mask, cleared at each ReadDone,
as the messages are filtered otherwise); the frames it stops at are read as
usual (a Message in another layout comes back to it re-encoded in the
canonical one). Each time the decoder is full, `decoder.take()` is a batch
for the caller, and the last one, not full, once the read is done. The
messages the batches and the decoder hold count against max_pending_msgs as
the queue's do. An error of the decoder (a value it cannot hold) ends the
read with that error.

Errors end the read, raised to the caller: a connection lost or a fatal
Error before the last ReadDone, a refusal other than NOT_MY_VBUCKET (a
BAD_POSITION: positions that are not this server's), vbuckets still
unanswered after the last round, the timeout. The messages already given
stay given: read the range again from its start (it is fixed: the same
messages come back).

`positions` is a read whose range is empty everywhere: `start_time` after
any message (the largest ns value), so every vbucket's ReadDone (of the
ones it covers, as a read's) tells where it stands (its epoch and next
offset) and no message is sent. It costs one ReadDone per vbucket, nothing
per retained message, and gives exactly the positions a later read's `stop`
(or `start`) takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Generator, Iterable, Mapping, Sequence
from operator import attrgetter, index
from typing import Any, NamedTuple, Protocol

from broky.client.connection import WorkerProtocol, open_connection, server_error
from broky.client.link import WorkerRef
from broky.errors import (
    BrokyConnectionError,
    BrokyError,
    BrokyTimeoutError,
    ErrorCode,
    ServerError,
)
from broky.matching import parse_pattern
from broky.protocol import (
    NO_OWNER,
    VBUCKETS,
    Error,
    Frame,
    Hello,
    Message,
    Read,
    ReadDone,
    VBucketMap,
    encode_frame,
    encode_message,
    vbucket_of,
)
from broky.protocol.frames import Position

RID = 1  # a read connection carries one read
MAX_ROUNDS = 3  # asking again for the vbuckets nobody answered for (moves during the read)
DEFAULT_MAX_PENDING_MSGS = 65536  # messages waiting for the caller before the reads pause
END_OF_TIME = (1 << 63) - 1  # a start_time after every message: an empty range everywhere
_U64 = (1 << 64) - 1
_vbucket_of = attrgetter("vbucket")


class RangeEnd(NamedTuple):
    """Where one vbucket's range of a read ended (its ReadDone)."""

    vbucket: int
    epoch: int  # the epoch of the range
    next: int  # the first offset after the range
    evicted: int = 0  # offsets of the range that were evicted before they could be read
    epoch_changed: bool = False  # the start named an epoch that is gone: what followed it is lost

    @property
    def position(self) -> Position:
        """The range's last position: the `start` of a read that goes on from here (and the
        `stop` of one that ends here)."""
        return Position(self.vbucket, self.epoch, self.next - 1)


class ReadVia(NamedTuple):
    """A worker to ask first for a vbucket: the one that owned it when the read's start was
    taken. After a planned move it still retains what it accepted of the vbucket before
    the handover and answers that part (ReadDone.moved); the rest comes from the owner."""

    node_id: str
    host: str
    port: int
    worker: int


def positions_of(ends: dict[int, RangeEnd]) -> tuple[Position, ...]:
    """Each vbucket's last position, in vbucket order."""
    return tuple(ends[vb].position for vb in sorted(ends))


class ReadResult(NamedTuple):
    """A whole bounded read: its messages, by vbucket then offset (the same list for the same
    range), and where each vbucket's range ended."""

    messages: list[Message]
    ends: dict[int, RangeEnd]  # by vbucket, in vbucket order

    @property
    def positions(self) -> tuple[Position, ...]:
        """Every vbucket's last position: pass them as the next read's `start`."""
        return positions_of(self.ends)

    @property
    def evicted(self) -> int:
        """Offsets of the range, all vbuckets together, evicted before they could be read."""
        return sum(end.evicted for end in self.ends.values())


class BulkDecoder(Protocol):
    """What `Reading.batches` asks of its decoder (broky.spark.readcols's decoders are two)."""

    @property
    def rows(self) -> int:
        """Messages taken since the last take()."""

    @property
    def full(self) -> bool:
        """Whether the batch is full: scan takes nothing more before a take()."""

    def scan(self, data: bytes, pos: int, end: int, vbuckets: Any, max_frame: int, /) -> int:
        """Take the whole Message frames of data[pos:end] it reads (those of a vbucket whose
        byte in `vbuckets` is 0: passed over), until a frame it does not take or a full
        batch; return the position after the last one it took or passed over."""

    def take(self) -> Any:
        """The batch (what the caller gets); a new one starts."""


class MapInfo(Protocol):
    """The part of the client's ServerInfo a read uses."""

    @property
    def map(self) -> VBucketMap: ...


class ReadOwner(Protocol):
    """What a read needs of its client (`broky.client.client.Client` is one)."""

    name: str | None
    auth_token: str | None
    connect_timeout: float
    tls: ssl.SSLContext | None  # a broky+tls:// server's (as its Links connect)

    @property
    def server_info(self) -> MapInfo | None: ...

    def address_of(self, node_id: str) -> tuple[str, int]:
        """Where node `node_id` listens (as a Link connects to it)."""


# A position as a caller may give one: a Position; (vbucket, epoch, offset) as any sequence,
# which is what json.loads gives back of json.dumps(sub.positions()); or a mapping with those
# keys (others are ignored: a `broky sub --json` line has them). Each number an int, or a
# string of decimal digits (how JSON for readers without 64-bit integers writes an epoch).
PositionLike = Position | Sequence[int | str] | Mapping[str, Any]


def as_positions(positions: Iterable[PositionLike] | None, what: str) -> tuple[Position, ...]:
    """`positions` (`subscribe`'s since, `read`'s start and stop) as Position values, checked.

    Raises:
        ValueError: naming `what`: not a list of positions (a str, a dict, not iterable),
            one that is not a position (see PositionLike; vbucket 0 .. 1023, epoch and
            offset 0 .. 2**64 - 1), or a vbucket named twice.
    """
    if positions is None:
        return ()
    wanted = "a list of positions (vbucket, epoch, offset)"
    if isinstance(positions, (str, bytes, bytearray, Mapping)):
        hint = " (json.loads the text first)" if isinstance(positions, str) else ""
        raise ValueError(f"{what}: expected {wanted}, not a {type(positions).__name__}{hint}")
    try:
        items = list(positions)
    except TypeError:
        raise ValueError(f"{what}: expected {wanted}, not {positions!r}") from None
    out: list[Position] = []
    seen: set[int] = set()
    for p in items:
        fields = _position_fields(p)
        numbers = None if fields is None else [_u64_of(x) for x in fields]
        if numbers is None or None in numbers:
            raise ValueError(
                f"{what}: {p!r} is not a position: (vbucket, epoch, offset), or a mapping with those "
                "keys, each an integer 0 .. 2**64 - 1 (or a string of its decimal digits)"
            )
        vb, epoch, offset = numbers
        assert vb is not None and epoch is not None and offset is not None
        if vb >= VBUCKETS:
            raise ValueError(f"{what}: {p!r}: {vb} is not a vbucket (0 .. {VBUCKETS - 1})")
        if vb in seen:
            raise ValueError(f"{what}: vbucket {vb} is named twice")
        seen.add(vb)
        out.append(Position(vb, epoch, offset))
    return tuple(out)


def _position_fields(p: Any) -> tuple[Any, ...] | None:
    """(vbucket, epoch, offset) of one PositionLike, unchecked; None if it has no such shape."""
    if isinstance(p, Mapping):
        try:
            return p["vbucket"], p["epoch"], p["offset"]
        except KeyError:
            return None
    if isinstance(p, (str, bytes, bytearray)):
        return None
    try:
        fields = tuple(p)
    except TypeError:
        return None
    return fields if len(fields) == 3 else None


def _u64_of(x: Any) -> int | None:
    """An unsigned 64-bit integer given as an int or as its decimal digits; else None."""
    if isinstance(x, str) and x.isascii() and x.isdigit():
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= _U64:
        return None
    return x


def as_vbuckets(vbuckets: Iterable[int] | None) -> frozenset[int] | None:
    """`vbuckets` as a set, checked (None: every vbucket).

    Raises:
        ValueError: one is not a vbucket (0 .. 1023) or is named twice, or there is none.
        TypeError: one is not an int.
    """
    if vbuckets is None:
        return None
    out: set[int] = set()
    for vb in vbuckets:
        vb = index(vb)
        if not 0 <= vb < VBUCKETS:
            raise ValueError(f"vbuckets: {vb} is not a vbucket (0 .. {VBUCKETS - 1})")
        if vb in out:
            raise ValueError(f"vbuckets: {vb} is named twice")
        out.add(vb)
    if not out:
        raise ValueError("vbuckets is empty: the read would cover no vbucket")
    return frozenset(out)


class Reading:
    """A bounded read under way: await it (a ReadResult) or iterate it (messages)."""

    def __init__(
        self,
        owner: ReadOwner,
        pattern: bytes,
        partition: bytes | None = None,
        *,
        start: tuple[Position, ...] = (),
        start_time: int = 0,
        stop: tuple[Position, ...] = (),
        vbuckets: frozenset[int] | None = None,
        via: dict[int, ReadVia] | None = None,
        timeout: float | None = None,
        max_pending_msgs: int = DEFAULT_MAX_PENDING_MSGS,
    ) -> None:
        parse_pattern(pattern)  # BadPatternError now, not from the server
        covers = set(range(VBUCKETS)) if vbuckets is None else set(vbuckets)
        if partition is not None:
            vb = vbucket_of(partition)
            if vb not in covers:
                raise ValueError(f"the partition's vbucket ({vb}) is not among `vbuckets`: nothing to read")
            covers = {vb}
        self.owner = owner
        # Each worker's Read is this with the vbuckets asked of it (`read_worker`).
        self.request = Read(RID, pattern, partition, start, start_time, stop)
        encode_frame(self.request)  # LocalProtocolError now for what the wire cannot carry
        self.covers = covers
        self.starts = {p.vbucket: p for p in start}  # moved on past a handover (`end`)
        self.stops = {p.vbucket: p for p in stop}
        self.via = {vb: w for vb, w in (via or {}).items() if vb in covers}  # the first round only
        self.carried: dict[int, tuple[int, bool]] = {}  # vb -> (evicted, epoch_changed) before a move
        self.timeout = timeout
        self.max_pending = max_pending_msgs
        self.ends: dict[int, RangeEnd] = {}  # filled as the ReadDones come
        self.queue: deque[Message] = deque()
        # In bulk (`batches`): the decoder, and its full batches waiting for the caller
        self.decoder: BulkDecoder | None = None
        self.ready: deque[tuple[Any, int]] = deque()  # (batch, its messages)
        self.ready_rows = 0
        self.wake = asyncio.Event()
        self.runner: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.paused = False
        self.protos: set[WorkerProtocol] = set()
        self.maps: list[VBucketMap] = []  # the maps of the read connections' Welcomes

    def __repr__(self) -> str:
        return f"<broky.Reading {len(self.ends)}/{len(self.covers)} vbuckets done>"

    # ---------------------------------------------------------------- the caller's side

    def __await__(self) -> Generator[Any, None, ReadResult]:
        return self.collect().__await__()

    def __aiter__(self) -> AsyncIterator[Message]:
        return self.stream()

    @property
    def positions(self) -> tuple[Position, ...]:
        """Every vbucket's last position so far (all of them once the read is done)."""
        return positions_of(self.ends)

    def batches(self, decoder: BulkDecoder) -> AsyncIterator[Any]:
        """The read's messages decoded in bulk by `decoder` (see "In bulk" above): a batch
        (`decoder.take()`) each time it is full, then the last one, not full (none if it
        would be empty); `reading.ends` once done.

        Raises:
            RuntimeError: the read was awaited or iterated already.
        """
        if self.runner is not None or self.decoder is not None:
            raise RuntimeError("batches(): this read was awaited or iterated already")
        self.decoder = decoder
        return self.stream_batches(decoder)

    async def stream_batches(self, decoder: BulkDecoder) -> AsyncIterator[Any]:
        self.begin()
        try:
            while True:
                if self.ready:
                    batch, rows = self.ready.popleft()
                    self.ready_rows -= rows
                    self.taken()
                    yield batch
                elif self.finished:
                    if self.error is None and decoder.rows:
                        yield decoder.take()
                    break
                else:
                    await self.wait()
        finally:
            await self.close()
        if self.error is not None:
            raise self.error

    async def collect(self) -> ReadResult:
        """Every message of the read, then its ends (what awaiting the Reading gives)."""
        self.in_messages()
        self.begin()
        messages: list[Message] = []
        try:
            while True:
                if self.queue:
                    messages.extend(self.queue)
                    self.queue.clear()
                    self.taken()
                elif self.finished:
                    break
                else:
                    await self.wait()
        finally:
            await self.close()
        if self.error is not None:
            raise self.error
        # The workers' answers interleave as they come; each vbucket's is in offset order (one
        # worker's), so a stable sort by vbucket (a merge of those runs) orders the whole.
        messages.sort(key=_vbucket_of)
        return ReadResult(messages, dict(sorted(self.ends.items())))

    async def stream(self) -> AsyncIterator[Message]:
        """The messages as they come (what iterating the Reading gives)."""
        self.in_messages()
        self.begin()
        try:
            while True:
                if self.queue:
                    msg = self.queue.popleft()
                    self.taken()
                    yield msg
                elif self.finished:
                    break
                else:
                    await self.wait()
        finally:
            await self.close()
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        """Stop the read (if it is still going) and close its connections."""
        runner = self.runner
        if runner is not None and not runner.done():
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        for proto in list(self.protos):
            proto.abort()

    def in_messages(self) -> None:
        if self.decoder is not None:
            raise RuntimeError("this read gives its messages in batches (batches()): not as messages")

    def begin(self) -> None:
        if self.runner is None:
            self.runner = asyncio.get_running_loop().create_task(self.run())

    async def wait(self) -> None:
        self.wake.clear()
        await self.wake.wait()

    def pending(self) -> int:
        """Messages waiting for the caller: queued, or in batches (and the decoder's)."""
        decoder = self.decoder
        return len(self.queue) if decoder is None else self.ready_rows + decoder.rows

    def taken(self) -> None:
        if self.paused and self.pending() <= self.max_pending >> 1:
            self.paused = False
            for proto in self.protos:
                if proto.transport is not None and not proto.closed:
                    proto.transport.resume_reading()

    # ---------------------------------------------------------------- the workers' side

    def push(self, msg: Message) -> None:
        self.queue.append(msg)
        self.wake.set()
        if not self.paused and len(self.queue) > self.max_pending:
            self.pause()

    def pause(self) -> None:
        self.paused = True
        for proto in self.protos:
            if proto.transport is not None and not proto.closed:
                proto.transport.pause_reading()

    def scan(self, data: bytes, pos: int, end: int, vbuckets: bytearray, max_frame: int) -> int:
        """A worker's bytes into the decoder (see "In bulk"); where it stopped."""
        decoder = self.decoder
        assert decoder is not None
        while True:
            pos = decoder.scan(data, pos, end, vbuckets, max_frame)
            if not decoder.full:
                break
            rows = decoder.rows
            self.ready.append((decoder.take(), rows))
            self.ready_rows += rows
            self.wake.set()
        if not self.paused and self.ready_rows + decoder.rows > self.max_pending:
            self.pause()
        return pos

    def end(self, done: ReadDone) -> None:
        vb = done.vbucket
        evicted, changed = self.carried.pop(vb, (0, False))
        evicted += done.evicted
        changed = changed or done.epoch_changed
        stop = self.stops.get(vb)
        if done.moved and (stop is None or (stop.epoch == done.epoch and done.next <= stop.offset)):
            # the worker handed the vbucket over at `next`: the rest of the range is at its owner
            self.carried[vb] = (evicted, changed)
            self.starts[vb] = Position(vb, done.epoch, done.next - 1)
            return
        self.ends[vb] = RangeEnd(vb, done.epoch, done.next, evicted, changed)
        self.wake.set()

    async def run(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                for _ in range(MAX_ROUNDS):
                    todo = self.covers - self.ends.keys()
                    if not todo:
                        break
                    await self.round(todo)
                missing = self.covers - self.ends.keys()
                if missing:
                    raise BrokyError(
                        f"{len(missing)} vbuckets (from {min(missing)}) were not read: no worker "
                        f"answered for them in {MAX_ROUNDS} rounds (their owners changed meanwhile)"
                    )
        except TimeoutError:
            self.error = BrokyTimeoutError(f"the read did not complete within {self.timeout:g} s")
        except asyncio.CancelledError:
            self.error = BrokyConnectionError("the read was closed before it completed")
            raise
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished = True
            self.wake.set()

    def newest_map(self) -> VBucketMap:
        info = self.owner.server_info
        if info is None:
            raise BrokyConnectionError("the client is not connected; await connect() first")
        return max([info.map, *self.maps], key=lambda vmap: vmap.version)

    async def round(self, todo: set[int]) -> None:
        """Ask each owner (per the newest map) for its vbuckets of `todo`; in the first round,
        the `via` workers for theirs."""
        vmap = self.newest_map()
        asked: dict[WorkerRef, set[int]] = {}
        addresses: dict[WorkerRef, tuple[str, int]] = {}
        via, self.via = self.via, {}
        for vb in todo:
            w = via.get(vb)
            if w is not None:
                ref = WorkerRef(w.node_id, w.worker)
                addresses[ref] = (w.host, w.port)
                asked.setdefault(ref, set()).add(vb)
                continue
            owner = vmap.owners[vb]
            if owner != NO_OWNER:
                ref = WorkerRef(vmap.nodes[owner[0]].node_id, owner[1])
                asked.setdefault(ref, set()).add(vb)
        try:
            async with asyncio.TaskGroup() as group:
                for ref, vbs in asked.items():
                    group.create_task(self.read_worker(ref, vbs, addresses.get(ref)))
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None

    async def read_worker(
        self, ref: WorkerRef, vbs: set[int], address: tuple[str, int] | None = None
    ) -> None:
        """Read worker `ref`'s range of the vbuckets `vbs` on a connection of its own (at
        `address`: a `via` worker, which may be gone; then its vbuckets go to the next round)."""
        owner = self.owner
        host, port = address or owner.address_of(ref.node_id)
        hello = Hello(worker=ref.worker, client_name=owner.name, auth_token=owner.auth_token)
        try:
            proto, welcome = await open_connection(host, port, hello, owner.connect_timeout, tls=owner.tls)
        except (BrokyConnectionError, ServerError, OSError):
            if address is None:
                raise
            return  # the worker that owned them is gone: their owner is asked next round
        self.maps.append(welcome.map)
        starts = tuple(self.starts[vb] for vb in sorted(vbs) if vb in self.starts)
        frame = encode_frame(self.request._replace(start=starts, vbuckets=tuple(sorted(vbs))))
        answer = WorkerAnswer(self, ref, vbs, proto.max_frame_bytes)
        self.protos.add(proto)
        try:
            proto.attach(answer, on_run=answer.on_run if self.decoder is not None else None)
            if self.paused and proto.transport is not None:
                proto.transport.pause_reading()
            proto.write(frame)
            await answer.done
        finally:
            self.protos.discard(proto)
            proto.close()


class WorkerAnswer:
    """One worker's answer to a read (a connection.Handler)."""

    def __init__(self, reading: Reading, ref: WorkerRef, vbs: set[int], max_frame: int) -> None:
        self.reading = reading
        self.ref = ref
        self.vbs = vbs  # the vbuckets asked of this worker whose ReadDone has not come
        self.mask = bytearray(VBUCKETS)  # the same, a byte per vbucket (for a decoder)
        for vb in vbs:
            self.mask[vb] = 1
        self.max_frame = max_frame
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def finish(self, exc: BaseException | None = None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

    def on_message(self, msg: Message) -> None:
        if msg.vbucket not in self.vbs:
            return
        if self.reading.decoder is None:
            self.reading.push(msg)
            return
        # (in bulk: a Message in a layout the decoder does not read, in the canonical one)
        frame = encode_message(*msg)
        if self.take(frame, 0, len(frame), len(frame)) != len(frame) and not self.done.done():
            self.finish(BrokyError(f"the read's decoder did not take a message of vbucket {msg.vbucket}"))

    def on_run(self, data: bytes, pos: int, end: int) -> int:
        """The connection's bytes from pos into the read's decoder (in bulk); where it stopped."""
        return self.take(data, pos, end, self.max_frame)

    def take(self, data: bytes, pos: int, end: int, max_frame: int) -> int:
        if self.done.done():
            return end  # (the answer failed: what follows is dropped with the connection)
        try:
            return self.reading.scan(data, pos, end, self.mask, max_frame)
        except (OverflowError, ValueError, MemoryError) as exc:  # a value the decoder cannot hold
            self.finish(exc)
            return end

    def on_frame(self, frame: Frame) -> None:
        if isinstance(frame, ReadDone):
            if frame.rid == RID and frame.vbucket in self.vbs:
                self.vbs.discard(frame.vbucket)
                self.mask[frame.vbucket] = 0
                self.reading.end(frame)
            if frame.remaining == 0:
                self.finish()
        elif isinstance(frame, Error) and (frame.fatal or frame.rid == RID):
            if frame.code == ErrorCode.NOT_MY_VBUCKET and not frame.fatal:
                self.finish()  # its vbuckets go to the next round, asked of their owner
            else:
                self.finish(server_error(frame))

    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None:
        if isinstance(exc, ServerError):
            self.finish(exc)
            return
        why = f": {exc}" if exc is not None else ""
        where = f"worker {self.ref.worker} of {self.ref.node_id}"
        self.finish(BrokyConnectionError(f"the connection to {where} closed during the read{why}"))


__all__ = [
    "BulkDecoder",
    "DEFAULT_MAX_PENDING_MSGS",
    "END_OF_TIME",
    "RangeEnd",
    "ReadOwner",
    "ReadResult",
    "PositionLike",
    "ReadVia",
    "Reading",
    "as_positions",
    "as_vbuckets",
    "positions_of",
]
