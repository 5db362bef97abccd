"""Read Broky into Spark: the streaming source and the batch read, on positions.

``spark.readStream.format("broky")`` and ``spark.read.format("broky")`` land
here (registered with the sink, `broky.spark.register`). Every message a
worker accepted has a position (vbucket, epoch, offset, schema/README.md 4.1)
and stays readable, within its worker's replay buffer, by a bounded read
(5.2): from positions to positions, the same messages every time while they
are retained, and what is gone counted per vbucket. That is all a Spark
source needs: Spark's offsets are positions (`broky.spark.offsets`), a
micro-batch is the bounded read between two of them.

Theory of operation
-------------------
Driver. Spark keeps one `BrokyStreamReader` per query in a Python process of
the driver's and asks it, per trigger, for the latest offset and the input
partitions; each call opens a client (any of ``broky.servers``), asks, and
closes it. `initialOffset` resolves ``startingOffsets``: ``latest`` is where
every vbucket stands now (`Client.positions`), ``earliest`` the oldest
retained message, ``startingTimestamp`` the first retained one at or after a
time; both are found by one bounded read per worker whose every range is
empty (a `stop` at offset 0 of the current epoch: the range ends where it
would start, and the ReadDone says where that is, no message sent). A JSON of
positions is taken as is. `latestOffset` is `Client.positions` again, moved
on only where a vbucket has something newer (or another epoch), and cut to
``maxOffsetsPerTrigger`` offsets when Spark passes that limit. `partitions`
groups the vbuckets whose range is not empty by the worker that owns them in
the map of the moment: one input partition per worker, each carrying its
vbuckets' start and stop positions and the worker's address.

Executors. A task (`read_partition`) connects through its worker's node
first (then the seeds) and makes one bounded read of its vbuckets
(`Client.read` with ``vbuckets``), from the start positions to the stop
positions, in bulk (`Reading.batches`): the frames the connections receive
are decoded straight into the Arrow columns of the source's schema
(`broky.spark.readcols`, in C when its twin is built), a record batch per
ARROW_BATCH_ROWS messages, with no Message object per row. A retried task
reads the same range, so the same rows.

Moves. The driver remembers the map of the moment each offset was taken:
the one its client held just before it asked for the positions, never one
that came in while they did (a move then, and a position the old owner
gave would be remembered with the new owner, which holds none of the range
before the handover: told as loss, though the old owner had it all).
Each vbucket of a task is asked first (`Client.read`'s ``via``, by address)
of the worker that owned it when the batch's start was taken if that is
another worker than now (it moved between two batches), else of its owner
at planning (it may move before the task runs). After a planned move the
old owner still serves what it retained of the vbucket up to the handover
(a draining node lingers for it, ``--drain-linger``), and the SDK reads the
rest from the new owner: a planned move in the middle of a query loses
nothing. A batch replayed after the query restarted has no remembered map:
it asks the owners of the moment, and a move it slept through is told as
loss (below), never skipped.

Loss. A vbucket's ReadDone says how many offsets of its range were evicted
before they could be read, and whether its start named an epoch that is gone
(the worker restarted, a node failed over: what followed that position is
lost, how much is not known). With ``failOnDataLoss`` true (the default, as
Kafka's) the task raises `BrokyDataLossError` naming the vbuckets and counts,
so the query fails and its checkpoint stays at the last complete batch;
false: the task logs the loss (WARN, logger ``broky.spark``) and goes on from
the end of the range. Never a silent jump.

Restarts. The offsets are the whole state: a query restarted from its
checkpoint plans the batch it had logged but not committed with the same
positions, so it reads the same messages, and goes on from there.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from broky.client.reader import ReadVia
from broky.errors import BrokyConnectionError, BrokyError
from broky.protocol import NO_OWNER, VBUCKETS, vbucket_of
from broky.protocol.frames import Position
from broky.spark import offsets as off
from broky.spark import readcols
from broky.spark.sink import ClientConfig, task_identity

try:
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )
except ImportError:  # PySpark < 4.2: no admission control, no Trigger.AvailableNow
    ReadLimit = ReadMaxRows = ReadAllAvailable = None  # type: ignore[assignment,misc]
    SupportsTriggerAvailableNow = object  # type: ignore[assignment,misc]

log = logging.getLogger("broky.spark")

SCHEMA = StructType(
    [
        StructField("key_partition", BinaryType(), False),
        StructField("key", BinaryType(), False),
        StructField("payload", BinaryType(), False),
        StructField("ts_producer", TimestampType(), True),
        StructField("ts_broker", TimestampType(), True),
        StructField("uid", StringType(), True),
        StructField("vbucket", IntegerType(), False),
        StructField("epoch", StringType(), False),
        StructField("offset", LongType(), False),
    ]
)
DEFAULT_READ_TIMEOUT_MS = 300_000  # one task's read, whole
ARROW_BATCH_ROWS = 8192


class SourceConfigError(BrokyError, ValueError):
    """An option of the broky source is not valid (raised on the driver, before any task)."""


class BrokyDataLossError(BrokyError):
    """A read found that messages of its range are gone (``failOnDataLoss`` true)."""

    def __init__(self, losses: list[Loss], pattern: bytes) -> None:
        evicted = [x for x in losses if x.evicted]
        changed = [x for x in losses if x.epoch_changed]
        parts = []
        if evicted:
            n = sum(x.evicted for x in evicted)
            parts.append(
                f"{n} offsets of {off.describe(x.vbucket for x in evicted)} were gone before they "
                "could be read (evicted from the replay buffer: the query fell further behind than "
                "--replay-bytes or --replay-max-age holds; or retained by a node that left the cluster)"
            )
        if changed:
            where = ", ".join(f"{x.vbucket} after offset {x.after} of epoch {x.epoch}" for x in changed[:8])
            parts.append(
                f"the epoch of {off.describe(x.vbucket for x in changed)} is gone (a worker restarted or "
                f"a node failed over): what followed {where}{', ...' if len(changed) > 8 else ''} is lost, "
                "how much is not known"
            )
        super().__init__(
            f"broky source: data loss reading {pattern.decode(errors='replace')!r}: "
            + "; ".join(parts)
            + '. Set option "failOnDataLoss" to "false" to log such losses and go on.'
        )
        self.losses = losses


@dataclass(frozen=True)
class Loss:
    """What one vbucket's range lost."""

    vbucket: int
    evicted: int  # offsets evicted before they could be read
    epoch_changed: bool  # the start's epoch is gone
    epoch: int  # the start's epoch
    after: int  # the start's offset


@dataclass(frozen=True)
class SourceOptions:
    """The source's options, read once on the driver.

    Attributes:
        client: how to reach the broker (``broky.servers``, ``broky.auth.token``,
            ``broky.connect.timeout.ms``, ``broky.client.name``), as the sink's.
        pattern: option ``pattern``, the keys to read (default ``>``: all).
        key_partition: option ``key_partition``: only this one (its vbucket only).
        starting: option ``startingOffsets``: ``latest``, ``earliest`` or a JSON
            of positions (`broky.spark.offsets`).
        starting_time: option ``startingTimestamp`` (ms since the epoch, as
            Kafka's), ns here; 0: not set. It wins over ``startingOffsets``.
        ending: option ``endingOffsets`` (batch reads): ``latest`` or a JSON.
        ending_time: option ``endingTimestamp`` (batch reads, ms), ns here.
        max_offsets: option ``maxOffsetsPerTrigger`` (0: no limit).
        fail_on_data_loss: option ``failOnDataLoss`` (default true).
        read_timeout: seconds for one task's read (``broky.read.timeout.ms``).
    """

    client: ClientConfig
    pattern: bytes = b">"
    key_partition: bytes | None = None
    starting: str = "latest"
    starting_time: int = 0
    ending: str = "latest"
    ending_time: int = 0
    max_offsets: int = 0
    fail_on_data_loss: bool = True
    read_timeout: float = DEFAULT_READ_TIMEOUT_MS / 1000

    @classmethod
    def from_options(cls, options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
        """Read and check the options (raises SourceConfigError)."""
        from broky.matching import parse_pattern

        opts = {k.lower(): v for k, v in options.items()}
        try:
            client = ClientConfig.from_options(options)
        except ValueError as exc:
            raise SourceConfigError(str(exc).replace("broky sink", "broky source")) from None
        pattern = opts.get("pattern", ">").encode()
        try:
            parse_pattern(pattern)
        except ValueError as exc:
            raise SourceConfigError(f'option "pattern": {exc}') from None
        kp = opts.get("key_partition")
        starting = opts.get("startingoffsets", "latest" if streaming else "earliest").strip()
        ending = opts.get("endingoffsets", "latest").strip()
        for name, value in (("startingOffsets", starting), ("endingOffsets", ending)):
            if value not in ("latest", "earliest"):
                off.from_json(value, f'option "{name}"')  # checked here, on the driver
        if ending == "earliest":
            raise SourceConfigError(
                'option "endingOffsets": "earliest" would read nothing; use "latest" or positions'
            )
        if streaming and "endingoffsets" in opts:
            raise SourceConfigError(
                'option "endingOffsets" is for batch reads (spark.read); a stream has no end'
            )
        fail = opts.get("failondataloss", "true").strip().lower()
        if fail not in ("true", "false"):
            raise SourceConfigError(f'option "failOnDataLoss" must be "true" or "false", not {fail!r}')
        try:
            return cls(
                client=client,
                pattern=pattern,
                key_partition=kp.encode() if kp is not None else None,
                starting=starting,
                starting_time=_ms_to_ns(opts, "startingTimestamp"),
                ending=ending,
                ending_time=_ms_to_ns(opts, "endingTimestamp"),
                max_offsets=_whole(opts, "maxOffsetsPerTrigger", 0),
                fail_on_data_loss=fail == "true",
                read_timeout=_whole(opts, "broky.read.timeout.ms", DEFAULT_READ_TIMEOUT_MS) / 1000,
            )
        except off.OffsetError as exc:
            raise SourceConfigError(f"broky source: {exc}") from None


def _whole(opts: Mapping[str, str], name: str, default: int) -> int:
    """Option `name` (looked up in lower case) as a whole number >= 0."""
    text = opts.get(name.lower())
    if text is None:
        return default
    try:
        value = int(text.strip())
    except ValueError:
        raise SourceConfigError(f'option "{name}" must be a whole number, not {text!r}') from None
    if value < 0:
        raise SourceConfigError(f'option "{name}" must not be negative, not {value}')
    return value


def _ms_to_ns(opts: Mapping[str, str], name: str) -> int:
    return _whole(opts, name, 0) * 1_000_000  # ms since the epoch, as Kafka's


# ------------------------------------------------------------------ the driver's questions


def _run(coro: Any) -> Any:
    """Run one asyncio call to completion on an event loop of its own."""
    import uvloop

    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _client(opts: SourceOptions, name: str) -> Any:
    try:
        return await opts.client.connect(name)
    except BrokyConnectionError as exc:
        raise BrokyConnectionError(str(exc).replace("broky sink", "broky source")) from None


async def _positions(opts: SourceOptions) -> tuple[off.Offsets, Any]:
    """Where every vbucket (or the key_partition's) stands now, and the map the client held
    before it asked: never newer than the positions (see "Moves" in the header)."""
    client = await _client(opts, f"{opts.client.name}-driver")
    try:
        vmap = client.server_info.map  # before: the map moves on while the positions come in
        ps = await client.positions(partition=opts.key_partition, timeout=opts.client.connect_timeout * 4)
        return {p.vbucket: p for p in ps}, vmap
    finally:
        await client.close()


async def _resolve(opts: SourceOptions, start_time: int) -> off.Offsets:
    """Positions just before the oldest retained message of every vbucket (start_time 0), or
    before the first retained one with ts_broker >= start_time (ns): a read whose every
    range is empty (it stops at offset 0, before it would start), so only ReadDones come."""
    client = await _client(opts, f"{opts.client.name}-driver")
    try:
        timeout = opts.client.connect_timeout * 4
        now = await client.positions(partition=opts.key_partition, timeout=timeout)
        stop = [Position(p.vbucket, p.epoch, 0) for p in now]
        result = await client.read(
            b">", partition=opts.key_partition, start_time=start_time, stop=stop, timeout=timeout
        )
        return {vb: Position(vb, end.epoch, end.next - 1) for vb, end in result.ends.items()}
    finally:
        await client.close()


def initial_offsets(opts: SourceOptions, starting: str, starting_time: int) -> off.Offsets:
    """The positions a read starts after, from startingOffsets/startingTimestamp."""
    if starting_time:
        return _run(_resolve(opts, starting_time))  # type: ignore[no-any-return]
    if starting == "latest":
        return _run(_positions(opts))[0]  # type: ignore[no-any-return]
    if starting == "earliest":
        return _run(_resolve(opts, 0))  # type: ignore[no-any-return]
    given = off.from_json(starting, 'option "startingOffsets"')
    wanted = _covered(opts)
    given = {vb: p for vb, p in given.items() if vb in wanted}
    if wanted - given.keys():  # the ones it does not name: from the oldest retained
        earliest = _run(_resolve(opts, 0))
        given.update({vb: p for vb, p in earliest.items() if vb not in given})
    return given


def _covered(opts: SourceOptions) -> set[int]:
    """The vbuckets a read covers: every one, or the key_partition's."""
    if opts.key_partition is None:
        return set(range(VBUCKETS))
    return {vbucket_of(opts.key_partition)}


@dataclass
class ReadTask(InputPartition):
    """One input partition: the vbuckets of one worker, from start to stop positions."""

    node_id: str
    address: str  # host:port of the worker's node: the task connects there first
    worker: int
    vbuckets: tuple[int, ...]
    start: tuple[Position, ...]
    stop: tuple[Position, ...]
    via: tuple[tuple[int, str, str, int, int], ...] = ()  # per vbucket, the worker to ask first


def plan(
    opts: SourceOptions,
    start: Mapping[int, Position],
    end: Mapping[int, Position],
    vmap: Any,
    before: Any = None,
) -> list[ReadTask]:
    """The input partitions of the range from `start` to `end`: one per worker that owns
    vbuckets whose range is not empty, per `vmap` (the map of the moment). A vbucket whose
    owner in `before` (the map when `start` was taken) is another worker is asked of that
    one first: after a planned move it still holds the range up to the handover."""
    todo = off.changed(start, end)
    by_owner: dict[tuple[int, int], list[int]] = {}
    for vb in todo:
        owner = tuple(vmap.owners[vb])
        if owner == tuple(NO_OWNER):
            owner = (0, 0)  # nobody owns it now: any worker; the SDK asks whoever does by then
        by_owner.setdefault(owner, []).append(vb)
    tasks = []
    for (node, worker), vbs in sorted(by_owner.items()):
        n = vmap.nodes[node]
        tasks.append(
            ReadTask(
                n.node_id,
                f"{n.host}:{n.port}",
                worker,
                tuple(vbs),
                tuple(start[vb] for vb in vbs if vb in start),
                tuple(end[vb] for vb in vbs),
                _ask_first(before, vmap, vbs),
            )
        )
    return tasks


def _ask_first(before: Any, vmap: Any, vbs: list[int]) -> tuple[tuple[int, str, str, int, int], ...]:
    """(vbucket, node_id, host, port, worker) of the worker to ask first for each of `vbs`:
    its owner in `before` when that was another worker (the range's start is there),
    else its owner in `vmap` (the batch's end was taken there; it may move before the
    task runs, and then still holds the range up to the handover)."""
    out = []
    for vb in vbs:
        now = _worker_of(vmap, vb)
        was = _worker_of(before, vb) if before is not None else None
        pick = was if was is not None and (now is None or (was[0], was[3]) != (now[0], now[3])) else now
        if pick is not None:
            out.append((vb, *pick))
    return tuple(out)


def _worker_of(vmap: Any, vb: int) -> tuple[str, str, int, int] | None:
    """(node_id, host, port, worker) of vb's owner in `vmap`, None if nobody owns it."""
    node, worker = vmap.owners[vb]
    if (node, worker) == tuple(NO_OWNER):
        return None
    n = vmap.nodes[node]
    return n.node_id, n.host, n.port, worker


def _key(offset: Mapping[str, Any]) -> str:
    return json.dumps(offset, sort_keys=True)


# ------------------------------------------------------------------ the executors' reads


def read_partition(task: ReadTask, opts: SourceOptions) -> Iterator[Any]:
    """Read one input partition: Arrow record batches of SCHEMA (the body of every ``read``)."""
    import pyarrow as pa

    partition, attempt = task_identity()
    config = opts.client
    seeds = (task.address, *(s for s in config.servers if s != task.address))
    config = replace(config, servers=seeds, sdk_options={})  # (its TLS options too)
    import uvloop

    loop = uvloop.new_event_loop()
    started = time.perf_counter()
    rows = 0
    try:
        client = loop.run_until_complete(_client_of(config, f"{config.name}-read-p{partition}-a{attempt}"))
        try:
            reading = client.read(
                opts.pattern,
                partition=opts.key_partition,
                vbuckets=task.vbuckets,
                via={vb: ReadVia(node_id, host, port, w) for vb, node_id, host, port, w in task.via},
                start=task.start,
                stop=task.stop,
                timeout=opts.read_timeout,
            )
            batches = reading.batches(readcols.new_decoder(ARROW_BATCH_ROWS)).__aiter__()
            try:
                while True:  # one turn of the event loop per Arrow batch, not per message
                    try:
                        cols = loop.run_until_complete(batches.__anext__())
                    except StopAsyncIteration:
                        break
                    rows += cols[0]
                    yield readcols.arrow_batch(pa, arrow_schema(pa), cols)
            finally:
                loop.run_until_complete(batches.aclose())  # (left early: its connections closed)
            check_losses(task, reading.ends, opts)
        finally:
            loop.run_until_complete(client.close())
    finally:
        loop.close()
    log.info(
        "broky source: partition %d (attempt %d) read %d rows of %d vbuckets of worker %d of %s in %.3f s",
        partition,
        attempt,
        rows,
        len(task.vbuckets),
        task.worker,
        task.node_id,
        time.perf_counter() - started,
    )


async def _client_of(config: ClientConfig, name: str) -> Any:
    try:
        return await config.connect(name)
    except BrokyConnectionError as exc:
        raise BrokyConnectionError(str(exc).replace("broky sink", "broky source")) from None


_ARROW: list[Any] = []  # the Arrow schema of SCHEMA, made at the first batch


def arrow_schema(pa: Any) -> Any:
    """SCHEMA in Arrow's types: the columns of broky.spark.readcols, in its order."""
    if not _ARROW:
        ts = pa.timestamp("us", tz="UTC")
        types = [
            pa.binary(),
            pa.binary(),
            pa.binary(),
            ts,
            ts,
            pa.string(),
            pa.int32(),
            pa.string(),
            pa.int64(),
        ]
        fields = [pa.field(f.name, t, f.nullable) for f, t in zip(SCHEMA.fields, types, strict=True)]
        _ARROW.append(pa.schema(fields))
    return _ARROW[0]


def check_losses(task: ReadTask, ends: Mapping[int, Any], opts: SourceOptions) -> None:
    """Raise (failOnDataLoss) or log what the read's ranges lost."""
    starts = {p.vbucket: p for p in task.start}
    losses = []
    for vb in task.vbuckets:
        end = ends.get(vb)
        if end is None or not (end.evicted or end.epoch_changed):
            continue
        p = starts.get(vb, Position(vb, end.epoch, 0))
        losses.append(Loss(vb, end.evicted, end.epoch_changed, p.epoch, p.offset))
    if not losses:
        return
    error = BrokyDataLossError(losses, opts.pattern)
    if opts.fail_on_data_loss:
        raise error
    log.warning("%s (failOnDataLoss is false: going on)", error)


# ------------------------------------------------------------------ Spark's interfaces


class BrokyStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("broky")``: micro-batches between positions."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.target: off.Offsets | None = None  # Trigger.AvailableNow: read up to here
        # The map of the moment each recent offset was taken, by its JSON: a batch's tasks ask
        # a vbucket's owner at its start first, should it have moved since (`plan`, `via`).
        self.maps: dict[str, Any] = {}

    def _taken(self, offsets: off.Offsets, vmap: Any) -> dict[str, Any]:
        doc = off.to_json(offsets)
        self.maps[_key(doc)] = vmap
        return doc

    def initialOffset(self) -> dict[str, Any]:
        offsets = initial_offsets(self.opts, self.opts.starting, self.opts.starting_time)
        return self._taken(offsets, _run(_positions(self.opts))[1])

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_offsets and ReadMaxRows is not None:
            return ReadMaxRows(self.opts.max_offsets)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = _run(_positions(self.opts))[0]

    def latestOffset(self, start: dict[str, Any] | None = None, limit: Any = None) -> dict[str, Any]:
        begin = off.from_json(start, "the checkpoint's offset") if start is not None else {}
        now, vmap = _run(_positions(self.opts))
        latest = self.target if self.target is not None else now
        if ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
            end = off.limited(begin, latest, limit.max_rows)
        else:
            end = off.moved_on(begin, latest)
        return self._taken(end, vmap)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[ReadTask]:
        begin = off.from_json(start, "the checkpoint's start offset")
        stop = off.from_json(end, "the checkpoint's end offset")
        before = self.maps.get(_key(start))
        vmap = self.maps.get(_key(end))
        self.maps = {_key(end): vmap} if vmap is not None else {}
        if not off.changed(begin, stop):
            return []
        if vmap is None:  # a batch logged before a restart
            vmap = _run(_positions(self.opts))[1]
        return plan(self.opts, begin, stop, vmap, before)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, ReadTask)
        return read_partition(partition, self.opts)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # nothing is kept on the server for a reader: its checkpoint is the state


class BrokyBatchReader(DataSourceReader):
    """``spark.read.format("broky")``: what is retained between two positions (or times)."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> list[ReadTask]:
        opts = self.opts
        start = initial_offsets(opts, opts.starting, opts.starting_time)
        now, vmap = _run(_positions(opts))
        if opts.ending_time:
            end = _run(_resolve(opts, opts.ending_time))
        elif opts.ending == "latest":
            end = now
        else:  # the vbuckets it does not name: up to now
            given = off.from_json(opts.ending, 'option "endingOffsets"')
            end = {vb: given.get(vb, p) for vb, p in now.items()}
        return plan(opts, start, end, vmap)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, ReadTask)
        return read_partition(partition, self.opts)
