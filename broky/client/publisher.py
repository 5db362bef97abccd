"""The publish path: from `publish`'s arguments to a frame queued on a Link.

Theory of operation
-------------------
`Publisher` is the publishing half of `broky.client.client.Client` (the
Client inherits it, so `publish` runs on the object the caller holds, with
its cache one attribute away: no delegation on the hot path). The frame's
bytes come from a `PublishEncoder` (broky.client.encoder: templates per
(key_partition, key, payload length), KSUIDs); the Link owning
`vbucket_of(key_partition)` comes from the client's Router
(broky.client.routing: a 1024-entry route table).

`publish` encodes the Message frame, checks its size against the server's
max_frame_bytes, picks the Link and appends the frame to the Link's outbound
list. The fast path does it with one cache lookup per publish:
key_partition -> key -> payload length -> (encoder template, Link), then
the steps of `PublishEncoder.encode` and `Link.send`, inlined. The cache is
dropped when the map or max_frame_bytes changes (`forget_routes`), and
cleared when it holds MAX_TEMPLATES entries. With the compiled twin
(broky.client.pubpack) those steps run in C, in one call
(`FastPath.publish`): the lookup, the frame stamped from the cached sample
frame, and the Link's bookkeeping on its state kept in C (`LinkState`).
Anything else (a miss, str
fields, other field types, a uid neither True nor 20 bytes, a closed
client, a pack error) takes the general path (`_publish`), which raises the
errors and, once the encoder has a template for the shape (the second time
it comes), fills the cache (`_remember`). Every path publishes before its
first await, but for one: the wait for room below, which `publish_nowait`
turns off (`_nowait`) to run `publish` up to its first await.

The Link writes its outbound list in one `transport.write` when it reaches
`batch_size` bytes or `linger` seconds later (see broky.client.link). When a
batch has just been written, `publish` yields to the event loop once (or
until the socket drains, if its write buffer is over its high-water mark),
so a tight publish loop cannot starve the readers. While a Link is down its
outbound list is bounded by `max_reconnect_buffer_bytes`; past that,
`publish` waits for the Link to come up, at most flush_timeout seconds,
then raises PublishBufferFullError if it is still full (counted in
`stats.refused`). The first connection to a worker is opened when the first
publish for it comes (broky.client.routing): a tight loop fills 8 MiB in
tens of milliseconds, before that connection is open, so the wait is part
of every burst to a new worker, not only of a worker's restart.

`publish_rows` is the bulk path (`publish_many`, and the Spark sink with its
deterministic uids): the fast path's steps in one
loop over columns, without an await per row; where `publish` would raise
PublishBufferFullError (the owner is down, its buffer full) it waits for the
owner to come back first, up to flush_timeout (`_room_for`). `send_encoded` queues a frame
the blocking client (broky.client.sync) encoded and size-checked in its
caller's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import warnings
from collections.abc import Sequence
from typing import Any

from broky.client import pubpack
from broky.client.encoder import MAX_TEMPLATES, PublishEncoder, Template, as_bytes, payload_bytes
from broky.client.link import Link
from broky.client.routing import Router
from broky.client.stats import ClientStats
from broky.errors import BrokyError

_time_ns = time.time_ns
# The compiled twin's functions (broky.client.pubpack), or None: the pure-Python loops.
_FastPath = None if pubpack.compiled is None else pubpack.compiled.FastPath
_pack_rows = None if pubpack.compiled is None else pubpack.compiled.pack_rows
MAX_SLOTS = 65536  # key_partitions the bulk path keeps the Link of (then it starts again)
# The compiled bulk path writes at least this much per write: its rows are all at hand,
# so a bigger write delays none of them, and costs the client and the worker fewer
# wake-ups (a quarter less client CPU per message than 64 KiB writes; bench/README.md).
BULK_WRITE_BYTES = 256 << 10
# ... in chunks of at most this many bytes (a writev of them): under the C allocator's
# threshold for mapping fresh pages (128 KiB), so chunks mostly reuse heap memory the
# ones before freed: half the page faults of one chunk per write, and a process's
# first 200,000 rows about 15 % faster (the same CPU once warm; bench/README.md).
BULK_CHUNK_BYTES = (64 << 10) - 64

# key_partition -> key -> payload length -> entry, its Link last: (pack, head, mid, block, Link) for the
# pure-Python path (see Template), (sample frame, Link) for the compiled one.
FastCache = dict[object, dict[object, dict[int, tuple[Any, ...]]]]


def old_form(
    call: str, key: Any, payload: Any, old: tuple[Any, ...], partition: Any, stacklevel: int
) -> tuple[Any, Any, Any]:
    """The arguments of the deprecated `publish(key_partition, key, payload)` form, as
    (key, payload, partition), with a DeprecationWarning pointing at the caller's line
    (`stacklevel` frames up from here; Python's warning filters show it once per line).

    It is told apart by a third positional argument (the payload): the new form takes
    two, the partition being a keyword. (`publish_many` likewise, with columns.)
    """
    if len(old) != 1 or partition is not None:
        raise TypeError(
            f"{call}() takes 2 positional arguments (key, payload; partition= is a keyword) "
            f"but {2 + len(old)} were given"
        )
    many = call == "publish_many"
    warnings.warn(
        f"{call}(key_partition{'s' if many else ''}, key{'s' if many else ''}, payload{'s' if many else ''}) "
        f"is deprecated: write {call}(key{'s' if many else ''}, payload{'s' if many else ''}"
        f"{', partitions=...' if many else ', partition=...'}) (the partition defaults to the key)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return payload, old[0], key


class Publisher:
    """Publishing, for `broky.client.client.Client` (which inherits it); see `publish`."""

    # The Client's, read by the publish path: its counters, the batch size
    # (see `broky.connect`), "connected and not closed" (the fast path's one
    # check) and its Router.
    stats: ClientStats
    batch_size: int
    flush_timeout: float
    _open: bool
    router: Router

    def __init__(self) -> None:
        self._nowait = False  # publish_nowait is running `publish`: it must not wait for room
        self._encoder = PublishEncoder()
        # one KSUID sequence for every path; with the compiled twin, its state is in C
        self._uids = self._encoder.uids = pubpack.new_sequence()
        self._fast: FastCache = {}
        self._fast_count = 0
        # publish's fast path over _fast in C (the compiled twin), or None
        self._fastpath: Any = (
            None if _FastPath is None else _FastPath(self._fast, self._uids, self.batch_size)
        )
        # The compiled bulk path's routes: key_partition -> index in _slot_links (its Link).
        self._slots: dict[bytes, int] = {}
        self._slot_links: list[Link] = []

    def _check_usable(self) -> None:
        """Raise why the client cannot publish (closed, or not connected yet): the Client's."""
        raise NotImplementedError

    def publish_nowait(
        self,
        key: bytes | str,
        payload: bytes,
        *old: Any,
        partition: bytes | str | None = None,
        ts_producer: int | None = None,
        uid: bool | bytes = True,
    ) -> None:
        """Queue one message without awaiting; same arguments and errors as `publish`.

        Unlike `publish` it never yields to the event loop, so a loop of
        publish_nowait calls must await something now and then (the writes
        happen when `batch_size` is reached or when the loop runs).
        """
        if old:  # the deprecated publish_nowait(key_partition, key, payload)
            key, payload, partition = old_form("publish_nowait", key, payload, old, partition, 2)
        # `publish` does all its work before its first await (its awaits only yield
        # to the loop after a batch was written), so running it up to that point is
        # publishing without waiting, on the same fast path.
        # (`_nowait` tells `publish` not to wait for room in a reconnect buffer: it raises
        # PublishBufferFullError at once instead.)
        coro = self.publish(key, payload, partition=partition, ts_producer=ts_producer, uid=uid)
        self._nowait = True
        try:
            coro.send(None)
        except StopIteration:
            return
        finally:
            self._nowait = False
        coro.close()

    async def publish(
        self,
        key: bytes | str,
        payload: bytes,
        *old: Any,
        partition: bytes | str | None = None,
        ts_producer: int | None = None,
        uid: bool | bytes = True,
    ) -> None:
        """Publish one message under `key`, to the worker that owns its partition.

        `publish(key, payload)`: the partition is the key (as `broky pub KEY
        PAYLOAD` does); `partition=` chooses another one, for the order of
        messages of several keys together (order holds per partition). The
        form of earlier versions, `publish(key_partition, key, payload)`, still
        publishes, with a DeprecationWarning (told apart by its third
        positional argument).

        The frame is queued and written with others (see `linger` and
        `batch_size`); `flush` tells when the server has processed it. When a
        batch has just been written, `publish` yields to the event loop once
        (or until the socket drains, if its write buffer is over its
        high-water mark), so a tight publish loop cannot starve the readers.

        Args:
            key: matched against subscription patterns; bytes, or str (UTF-8):
                literal tokens separated by dots (no empty, `*` or `>` token).
            payload: the message body (bytes).
            partition: the key_partition: chooses the shard (vbucket), and
                order holds per partition; bytes, or str (UTF-8), not empty.
                None (the default): the key.
            ts_producer: nanoseconds since the epoch; None = now, 0 = not set.
            uid: True = a new KSUID, False = none, or the 20 bytes to use.

        Raises:
            BadKeyError: the key is empty or has an empty or wildcard token, or the
                partition is empty: what `broky pub` refuses (nothing sent; a
                ValueError too; `argument` names which).
            PayloadTooLargeError: the frame exceeds the server's max_frame_bytes
                (nothing is sent; `size` and `limit` carry the numbers).
            PublishBufferFullError: the owning worker is disconnected and
                `max_reconnect_buffer_bytes` already wait for it, still after
                waiting up to flush_timeout for its connection to open or come
                back (`publish_nowait` does not wait; counted in `stats.refused`).
            BrokyConnectionError: reconnecting to the owning worker was given up
                (max_reconnect_attempts; counted in `stats.refused`).
            ClientClosedError: the client is closed.
            PayloadTypeError: the payload is not bytes-like (a str: encode it; a TypeError too).
            LocalProtocolError: a field cannot be encoded (wrong type, bad uid).
        """
        # The fast path, inlined: one cached template and Link per (key_partition,
        # key, payload length), then the steps of PublishEncoder.encode and Link.send.
        # Anything unusual (a miss, str fields, wrong types, uid neither True nor 20
        # bytes, closed client, a pack error) takes the general path, which raises
        # the errors. Every path publishes before its first await but the wait for
        # room in a down Link's buffer, which `publish_nowait` turns off.
        if old:  # the deprecated publish(key_partition, key, payload)
            key, payload, partition = old_form("publish", key, payload, old, partition, 2)
        key_partition = key if partition is None else partition
        try:
            pack, head, mid, block, link = self._fast[key_partition][key][len(payload)]
        except Exception:
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        if not self._open:
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        if uid is True:
            ts = _time_ns()
            seq = self._uids
            if not seq.start <= ts < seq.until:
                seq.roll(ts)
            n = seq.next
            seq.next = n + 1
            pre = seq.pre
        elif isinstance(uid, bytes) and len(uid) == 20:  # e.g. the Spark sink's deterministic uids
            ts = _time_ns() if ts_producer is None else 0
            pre = uid[:12]
            n = int.from_bytes(uid[12:], "little")  # the template packs the last 8 bytes as "<Q"
        else:
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        try:
            frame = pack(head, ts if ts_producer is None else ts_producer, mid, pre, n, block, payload)
        except struct.error:  # e.g. a str payload, a ts_producer out of range
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        proto = link.proto
        if proto is None:
            if link.out_bytes + len(frame) > link.client.max_reconnect_buffer_bytes and not self._nowait:
                await self._wait_up(link)  # then published below, or refused if still full
                if link.retired:  # its node left the map meanwhile: to the new owner
                    link = self.router.owner_link(as_bytes(key_partition, "partition"))
            try:
                link.send(frame)
            except BrokyError:  # buffer full, or given up: not published, counted as refused
                self.stats.refused += 1
                raise
            self.stats.published += 1
            return
        self.stats.published += 1
        link.out.append(frame)
        n = link.out_bytes = link.out_bytes + len(frame)
        if n >= self.batch_size:
            link.flush_out()
            # a batch was written: let the loop run once (readers, other tasks),
            # or wait for the socket if its buffer is over the high-water mark
            if proto.write_paused:
                await proto.drain()
            else:
                await asyncio.sleep(0)
        elif link.flush_handle is None:
            link.schedule_flush()

    _publish_pure = publish
    if _FastPath is not None:  # `publish` with the compiled twin (its own name: what Python's errors say)

        async def publish(
            self,
            key: bytes | str,
            payload: bytes,
            *old: Any,
            partition: bytes | str | None = None,
            ts_producer: int | None = None,
            uid: bool | bytes = True,
        ) -> None:
            # `publish` with the compiled twin: pubpack's FastPath runs the fast path's
            # steps in C (the cache lookup, the frame stamped from the cached sample
            # frame, appended to the Link's `out` and counted, its flush scheduled).
            # False from it (a miss, odd types, the Link down, a new second for the
            # sequence) and a uid other than True take the general path, as in `publish`.
            if old:  # the deprecated publish(key_partition, key, payload)
                key, payload, partition = old_form("publish", key, payload, old, partition, 2)
            key_partition = key if partition is None else partition
            if uid is True and self._open:
                link = self._fastpath.publish(key_partition, key, payload, ts_producer)
                if link is None:
                    self.stats.published += 1
                    return
                if link is not False:  # published, and its Link's batch is full: written now
                    self.stats.published += 1
                    proto = link.proto
                    link.flush_out()
                    if proto.write_paused:
                        await proto.drain()
                    else:
                        await asyncio.sleep(0)
                    return
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)

        publish.__doc__ = _publish_pure.__doc__

    async def publish_many(
        self,
        keys: Sequence[bytes | str],
        payloads: Sequence[bytes],
        *old: Any,
        partitions: Sequence[bytes | str] | None = None,
        ts_producers: Sequence[int | None] | None = None,
    ) -> int:
        """Publish many messages given as columns: message i is (keys[i], payloads[i]),
        under partitions[i] (default: its key), each with a new KSUID; the bulk
        producer's call.

        It does what `publish` does for each message, in one loop without an await
        per message (it yields only when a socket is backed up). Where `publish` would raise
        PublishBufferFullError because the owning worker is down and its buffer is
        full, it waits for the worker to come back, up to `flush_timeout`, first.
        Order per partition is the columns' order. Returns the number of
        messages; raises what `publish` raises, and then the messages before the
        one that raised are published. The form of earlier versions,
        `publish_many(key_partitions, keys, payloads)`, still publishes, with a
        DeprecationWarning.

        Args:
            keys, payloads: sequences of one length (list, tuple, or anything
                indexable); fields as in `publish`.
            partitions: None = each message's key; else one per message.
            ts_producers: None = now for every message; else one per message
                (None = now, 0 = not set).
        """
        if old:  # the deprecated publish_many(key_partitions, keys, payloads)
            keys, payloads, partitions = old_form("publish_many", keys, payloads, old, partitions, 2)
        key_partitions = keys if partitions is None else partitions
        n = len(keys)
        if (
            len(key_partitions) != n
            or len(payloads) != n
            or (ts_producers is not None and len(ts_producers) != n)
        ):
            raise ValueError(
                "publish_many: keys, payloads (and partitions, ts_producers) must have one length, "
                f"got {n}, {len(payloads)}"
                + ("" if partitions is None else f", {len(partitions)}")
                + ("" if ts_producers is None else f", {len(ts_producers)}")
            )
        await self.publish_rows(key_partitions, keys, payloads, ts_producers, None)
        return n

    async def publish_rows(
        self,
        key_partitions: Sequence[Any],
        keys: Sequence[Any],
        payloads: Sequence[Any],
        ts_producers: Sequence[int | None] | None,
        uid_prefix: bytes | None,
        uid_base: int = 0,
    ) -> None:
        """For `publish_many` and the Spark sink (broky.spark.sink), not for users: publish
        rows given as columns: row i is (key_partitions[i], keys[i], payloads[i],
        ts_producers[i] or now).

        The steps of `publish`'s fast path, in one loop, without an await per
        row: it yields only after writing a batch whose socket is over its
        high-water mark. uid_prefix None gives each row a new KSUID; else row i's
        uid is the 12 bytes uid_prefix then uid_base + i as 8 little-endian bytes
        (the Spark sink's deterministic uids). Raises what `publish` raises; the
        rows before the one that raised are published.

        With the compiled twin, pubpack's `pack_rows` runs the loop in C: it
        encodes the rows into chunks per Link (BULK_CHUNK_BYTES at most),
        appended to the Link's outbound list (`Link.out_extra` counts the
        publishes they hold beyond one per chunk), and
        stops after a row that fills a batch (`batch_size`, at least
        BULK_WRITE_BYTES) (written here, as `publish` does) or
        before a row that the pure-Python steps must take (`_publish_row`: a
        key_partition whose Link it was not given yet, a field that is not
        bytes, a down Link, a new second, an oversized frame).
        """
        if _pack_rows is None:
            return await self._publish_rows_pure(
                key_partitions, keys, payloads, ts_producers, uid_prefix, uid_base
            )
        slots = self._slots
        links = self._slot_links
        stats = self.stats
        encoder = self._encoder
        n = len(key_partitions)
        i = 0
        while i < n:
            up = self._open
            limit = max(self.batch_size, BULK_WRITE_BYTES)
            room = [limit - link.out_bytes if up and link.proto is not None else -1 for link in links]
            added = [0] * len(links)
            counts = [0] * len(links)
            outs = [link.out for link in links]
            before = [len(out) for out in outs]
            stop, full = _pack_rows(
                key_partitions, keys, payloads, ts_producers, i, slots, outs, added, counts, room,
                BULK_CHUNK_BYTES, encoder.max_frame_bytes, self._uids, uid_prefix, uid_base,
            )  # fmt: skip
            stats.published += stop - i
            for j, size in enumerate(added):
                if size:  # chunks of counts[j] publishes in all were appended to its `out`
                    link = links[j]
                    link.out_bytes += size
                    link.out_extra += counts[j] - (len(outs[j]) - before[j])
                    if j != full and link.flush_handle is None:
                        link.schedule_flush()
            i = stop
            if full >= 0:
                link = links[full]
                link.flush_out()
                proto = link.proto
                if proto is not None and proto.write_paused:  # the socket is backed up: wait for it
                    await proto.drain()
            elif i < n:
                await self._publish_row(key_partitions, keys, payloads, ts_producers, uid_prefix, uid_base, i)
                i += 1

    async def _publish_row(
        self,
        key_partitions: Sequence[Any],
        keys: Sequence[Any],
        payloads: Sequence[Any],
        ts_producers: Sequence[int | None] | None,
        uid_prefix: bytes | None,
        uid_base: int,
        i: int,
    ) -> None:
        """Row i of `publish_rows` by the general path (which raises the errors); then
        its key_partition's Link goes to the compiled loop's routes."""
        kp = key_partitions[i]
        payload = payloads[i]
        t = None if ts_producers is None else ts_producers[i]
        uid = True if uid_prefix is None else uid_prefix + (uid_base + i).to_bytes(8, "little")
        await self._room_for(kp, len(payload))
        written = self._publish(kp, keys[i], payload, t, uid)
        if written is not None and written.proto is not None and written.proto.write_paused:
            await written.proto.drain()
        slots = self._slots
        if kp.__class__ is bytes and kp not in slots:
            if len(slots) >= MAX_SLOTS:
                slots.clear()
                self._slot_links.clear()
            link = self.router.owner_link(kp)
            links = self._slot_links
            for j, known in enumerate(links):
                if known is link:
                    slots[kp] = j
                    break
            else:
                slots[kp] = len(links)
                links.append(link)

    async def _publish_rows_pure(
        self,
        key_partitions: Sequence[Any],
        keys: Sequence[Any],
        payloads: Sequence[Any],
        ts_producers: Sequence[int | None] | None,
        uid_prefix: bytes | None,
        uid_base: int = 0,
    ) -> None:
        # `publish_rows` without the compiled twin: the reference loop.
        fast = self._fast
        stats = self.stats
        seq = self._uids
        for i in range(len(key_partitions)):
            kp = key_partitions[i]
            key = keys[i]
            payload = payloads[i]
            t = None if ts_producers is None else ts_producers[i]
            try:
                pack, head, mid, block, link = fast[kp][key][len(payload)]
                proto = link.proto
                if proto is None or not self._open:
                    raise LookupError
                if uid_prefix is None:
                    ts = _time_ns()
                    if not seq.start <= ts < seq.until:
                        seq.roll(ts)
                    n = seq.next
                    seq.next = n + 1
                    frame = pack(head, ts if t is None else t, mid, seq.pre, n, block, payload)
                else:
                    n = uid_base + i
                    frame = pack(head, _time_ns() if t is None else t, mid, uid_prefix, n, block, payload)
            except (LookupError, TypeError, struct.error):  # not cached, down, closed, odd types
                uid = True if uid_prefix is None else uid_prefix + (uid_base + i).to_bytes(8, "little")
                await self._room_for(kp, len(payload))
                written = self._publish(kp, key, payload, t, uid)
                if written is not None and written.proto is not None and written.proto.write_paused:
                    await written.proto.drain()
                continue
            stats.published += 1
            link.out.append(frame)
            size = link.out_bytes = link.out_bytes + len(frame)
            if size >= self.batch_size:
                link.flush_out()
                if proto.write_paused:  # the socket is backed up: wait for it
                    await proto.drain()
            elif link.flush_handle is None:
                link.schedule_flush()

    async def _room_for(self, key_partition: Any, size: int) -> None:
        """The bulk path's back-pressure: while the owner of `key_partition` is down
        and its reconnect buffer cannot take `size` more bytes, wait for it to come
        back (a worker restarting: a second or so), at most flush_timeout seconds;
        then `_publish` raises PublishBufferFullError if it is still full."""
        if not self._open or key_partition.__class__ not in (bytes, str):
            return
        kp = key_partition if isinstance(key_partition, bytes) else str(key_partition).encode()
        link = self.router.owner_link(kp)
        if link.proto is None and link.out_bytes + size + 256 > link.client.max_reconnect_buffer_bytes:
            await self._wait_up(link)

    async def _wait_up(self, link: Link) -> None:
        """Wait until `link` is up (its first connection is being opened, or it reconnects),
        reconnecting is given up, its node left the map (`link.retired`: the caller
        publishes to the new owner), or flush_timeout seconds passed."""
        if link.proto is not None or link.failed is not None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.flush_timeout):
                await link.up.wait()

    async def _publish_general(
        self,
        key_partition: bytes | str,
        key: bytes | str,
        payload: bytes,
        ts_producer: int | None,
        uid: bool | bytes,
    ) -> None:
        if not self._nowait:
            try:
                size = len(payload) + len(key)
            except TypeError:
                size = 0  # a field of the wrong type: `_publish` raises for it
            await self._room_for(key_partition, size)
        link = self._publish(key_partition, key, payload, ts_producer, uid)
        if link is None:
            return
        proto = link.proto
        if proto is not None and proto.write_paused:
            await proto.drain()
        else:
            await asyncio.sleep(0)

    def _publish(
        self,
        key_partition: bytes | str,
        key: bytes | str,
        payload: bytes,
        ts_producer: int | None,
        uid: bool | bytes,
    ) -> Link | None:
        """Queue one publish; return its Link if that completed a batch written now."""
        if not self._open:
            self._check_usable()
        kp = key_partition if key_partition.__class__ is bytes else as_bytes(key_partition, "partition")
        k = key if key.__class__ is bytes else as_bytes(key, "key")
        if payload.__class__ is not bytes:
            payload = payload_bytes(payload)
        router = self.router
        given = isinstance(uid, bytes) and len(uid) == 20
        if uid is True or given:
            encoder = self._encoder
            # PayloadTooLargeError before anything is queued; a shape seen twice gets a template
            if given:
                frame, vb = encoder.encode_any(kp, k, payload, ts_producer, uid)  # type: ignore[arg-type]
            else:
                frame, vb = encoder.encode(kp, k, payload, ts_producer)
            link = router.route[vb] or router.fill(vb)
            template = encoder.template_of(kp, k, len(payload))
            if template is not None:  # from now on the fast path takes this shape
                self._remember(key_partition, key, kp, k, len(payload), template, link)
        else:
            frame, vb = self._encoder.encode_any(kp, k, payload, ts_producer, uid or None)
            link = router.route[vb] or router.fill(vb)
        try:
            wrote = link.send(frame)
        except BrokyError:  # buffer full, or given up: not published, counted as refused
            self.stats.refused += 1
            raise
        self.stats.published += 1
        return link if wrote else None

    def _remember(
        self,
        key_partition: object,
        key: object,
        kp: bytes,
        k: bytes,
        pay_len: int,
        template: Template,
        link: Link,
    ) -> None:
        """Cache the template and Link of a publish for `publish`'s fast path.

        Under the bytes fields, and also under the str ones if given as str.
        Dropped whenever a template or the route may change (map, max_frame_bytes).
        """
        if self._fast_count >= MAX_TEMPLATES:
            self._fast.clear()
            self._fast_count = 0
        pack, head, mid, block, _ = template
        entry: tuple[Any, ...]
        if _FastPath is None:
            entry = (pack, head, mid, block, link)
        else:  # the compiled path's sample: the frame with zero time, uid and payload
            entry = (pack(head, 0, mid, bytes(12), 0, block, bytes(pay_len)), link)
        self._fast.setdefault(kp, {}).setdefault(k, {})[pay_len] = entry
        self._fast_count += 1
        if key_partition.__class__ is str or key.__class__ is str:
            kp_str = key_partition if key_partition.__class__ is str else kp
            k_str = key if key.__class__ is str else k
            self._fast.setdefault(kp_str, {}).setdefault(k_str, {})[pay_len] = entry
            self._fast_count += 1

    def forget_routes(self) -> None:
        """For the Router (RouterOwner): drop the fast path's cache (templates and Links)
        and the bulk path's routes (the map changed)."""
        self._fast.clear()
        self._fast_count = 0
        self._slots.clear()
        self._slot_links.clear()

    def send_encoded(self, vb: int, frame: bytes) -> Link | None:
        """For the blocking client (broky.client.sync): queue an already encoded and
        size-checked publish.

        A refused publish raises and is not counted here: the caller counts it
        (under its own lock; see broky.client.sync).
        """
        router = self.router
        link = router.route[vb] or router.fill(vb)
        wrote = link.send(frame)
        self.stats.published += 1
        return link if wrote else None

    def _limit_frames(self, max_frame_bytes: int) -> None:
        """The server's max_frame_bytes (from a Welcome); templates and cache are dropped if it changed."""
        if self._encoder.set_limit(max_frame_bytes):
            self.forget_routes()


__all__ = ["Publisher"]
