"""The HTTP way in: publish with a POST, subscribe as a stream (ndjson, raw, Server-Sent Events).

Theory of operation
-------------------
Routes (registered on the master's HttpServer, broky.server.http.server, all under
/v1/, all `private`: with an --auth-token they need it, as a Bearer header, the
broky_token cookie or ?access_token=; with --users, a user's Basic credentials
do too, and the request acts as that user: `refusal` answers 403 for a key or
pattern outside its permissions, or for a user with `http = false`):

    POST /v1/pub/KEY?partition=P[&lines=0]   publish; JSON answer
    GET  /v1/sub/PATTERN?format=ndjson|raw|sse[&partition=P][&since_time=T][&last=N]
                                             a stream, chunked; SSE also when the
                                             request says Accept: text/event-stream

How a request reaches the workers (decided). The master holds one SDK
`Client` seeded at its own node (`sdk`, connected at the first /v1/
request, once, and kept; broky.client is loaded only then), which follows
the vbucket map as any SDK client does: a subscription is one SDK
subscription with an inline callback that appends to the stream's buffer.
A publish goes through a `Lane`: one connection per worker, of any node of
the map (opened at its first POST, with Hello.worker, once for every POST
that needs it meanwhile, and kept), on which the POST's messages go
straight to the worker that owns the partition's vbucket, in
one write, between two Reads of that vbucket's position (an empty range:
start_time after every message). A worker handles a connection's frames in
order, so the first ReadDone says where the vbucket stood before the
messages, the second where it stands after them, and the second also means
that the worker has processed them all (as a flush). Nothing per message
crosses processes but the message itself, once; the cost per request is two
small Reads on a connection already open, instead of a handshake and a
hand-off per request (a new connection per POST) or two bounded reads on
connections of their own (`Client.positions`). bench/README.md "HTTP"
measures it against the SDK's per-call publish.

In a cluster (decided: forward, not redirect). Any node answers a POST:
the lane goes to the owning worker wherever it is, so a POST for another
node's vbucket costs about what one POSTed at its owner does, where a 307
would add a round trip and a request's worth of the first node's CPU
(bench/README.md "HTTP", measured). A redirect would also fail its users: curl
follows one only with -L, webhooks and many HTTP libraries do not re-POST
a body, and the map names nodes' binary ports, not their HTTP ports, which
a load balancer may hide anyway. Past the master that took the POST, no
other process handles the messages on their way: they cross the network
once, from that master to the owning worker, as an SDK client's would.
This is no server-to-server data route (the nodes' own data path has
none: a publish goes from its client straight to the owning worker): the
gateway is a client of the cluster, as a program with the SDK is, and what
it forwards is its HTTP clients' publishes alone.

When the map moves under a POST. A worker refuses the messages of a
vbucket it no longer owns (NOT_MY_VBUCKET carries each back, in order, and
the lane gives them to their POST: `Batch.refused`); a lost lane (the node
died or left: Goodbye) fails its POSTs under way, and which of their
messages the node took is unknown. Either way the POST is tried once more
(`_place`) within its PUBLISH_TIMEOUT: the map is refreshed through the SDK
client (`Client.refresh_map`) every RETRY_INTERVAL until it names an owner
that answers (not the worker that refused), and what is left goes there:
the refused messages, or all of them after a lost lane (with their uids:
a subscriber can tell a message it gets twice). The answer then says so
("resent": how many, why, and whether some may have been published twice).
What cannot be placed is a 503 saying why, with how many messages were
published before ("published": null when unknown), never a silent drop.
A planned move keeps the vbucket's sequence, so a POST split by one is
still exact across the two workers. One moment of a move leaves a POST's
positions unknown (no bounds either): a worker takes the messages of a
vbucket moving to it once the map prepares the move, before it owns it and
answers Reads for it, so a gateway that follows the commit before that
worker does gets its Reads refused and its messages taken.

Publish. The body is split into lines as a text file is (every LF ends a
line, a CR before it is kept: bytes are bytes; what follows the last LF is a
last line unless it is empty), and each line is a message, an empty one
too; `?lines=0` takes the whole body as one message, an empty one too.
The key is the path after /v1/pub/, percent-decoded; `partition` defaults to
the key. The answer: {"published": n, "first": [vb, epoch, offset], "last":
[...], "exact": bool}. When the offsets moved by exactly n in one epoch
between the two Reads, nobody else's publish came in between (the
worker may take a large body in several reads, and serve other connections
between them) and first/last are exact; else they are the bounds the
messages lie within ("exact": false).

Subscribe. A `SubStream` holds what waits for the HTTP client, bounded by
`max_pending` bytes (STREAM_MAX_PENDING, or --max-pending-bytes if that is
smaller: this is the master's memory, which --memory-budget does not count,
and at most --http-max-connections streams hold it). Past it the stream
lags (below); the SDK connection it shares is never paused for it. Without
a replay buffer (--replay-bytes 0) there is nothing to read it from, and
the stream is cut (`cut_slow`, counted), after a last line saying so (SSE
`event: cut`), as any slow consumer is.

A slow reader lags (issue 40). A stream past its bound is sent nothing more
live: `lag` keeps, per vbucket, the position after which it goes on (just
before the first message of that vbucket it was not sent: it was sent every
earlier one, the SDK delivering each vbucket's in offset order), and `live`
the position of the last one it was not sent; a message it is not sent
costs it two dict stores, no copy, no formatting. Its `catch_up` task waits
until the client has taken what waited down to max_pending >> LAG_LOW_WATER,
then reads from history, with a bounded read of the SDK (broky.client.reader:
a connection of its own per worker, not the shared one) of the vbuckets it
is behind in, from `lag` up to `live` as they stood when the read began,
formatted in as the client takes what waits (over max_pending, the loop
waits, and the read's connections pause once READ_BATCH_MSGS messages wait:
the workers send a read only as fast as its connection drains). A read's
RangeEnds move `lag` on; a vbucket that had no live message meanwhile is
then caught up. Once none is behind, the stream is live again: that test
and the switch have no await between them, and the SDK calls `deliver`
from the same loop, so the next live message of each vbucket follows the
last one read: no gap, nothing twice (a message read is never one sent
live: it is at or before `live`, which the stream was not sent). What the
replay buffer evicted before a read got there is its ReadDones' `evicted`:
told as one loss (`evicted`, scope `stream`) per read, with their sum, which
is exact for a stream of `>` on every key_partition and, as the server's
EVICTED counts, an upper bound otherwise; a start in an epoch that is gone
is told `epoch_changed` (count unknown). MAX_READS streams read at once, the
others wait in line (`reads`), each read being short: at most what its
client takes. A read that fails (a worker lost during it) cuts the stream,
told (`event: cut` with the error): an event stream resumes with its
Last-Event-ID. A stream that stalls costs its positions and what already
waited for it, never more: it starts no read until its client takes what
waits; the HTTP server cuts an answer not taken within WRITE_TIMEOUT (10 s,
broky.server.http.server), so a stream whose client stalls that long ends
there, and an event stream's reconnect resumes it from its Last-Event-ID:
the replay then tells what was evicted meanwhile.

A stream covers the cluster: the SDK client subscribes on every worker of
every node (and follows the map as nodes come and go), so a stream on any
node carries every node's messages.

Formatting once (measured, bench/README.md "HTTP"). The master's one SDK
connection per worker gets each message once, however many streams match it,
and the SDK hands the same Message object to each stream's callback in turn:
the first stream formats it (its JSON, and the head of its SSE id: position
in base 36) and keeps it on the gateway (`formatted`), and the others find
it there (an identity check: the gateway holds the Message, so no other can
take its address). Each stream then adds only its own: the tail of its ids
(stream number and secret, `Ledger.id_tail`), and to its ledger the
message's position, one tuple the gateway made for all ledgers (with
tuples of their own, 1,000 streams whose ledgers were full took the
master's RSS from 31 MB to 128 MB; sharing them, to 61 MB).

Keepalives (measured, bench/README.md "HTTP"). An SSE stream that wrote
nothing for KEEPALIVE_SECONDS / 2 to KEEPALIVE_SECONDS gets a comment (":
keepalive"), so that proxies and browsers keep an idle stream open. One
task of the gateway ticks every KEEPALIVE_SECONDS / 2 for all streams: a
stream with nothing written since the tick before gets its comment. A
timeout on each stream's wait for data instead (the first version) made a
timer per stream per wake: on uvloop, with 1,000 streams waiting, a wake
cost 9.8 µs with its timeout, 2.3 µs without.

Losses the server tells: those naming the stream's subscription (a start
that asked for what is no longer retained: EVICTED, EPOCH_CHANGED) go to
that stream only; those of the gateway's connection to
a worker (sid 0: SLOW_CONSUMER, CONNECTION_LOST, ...) go to every stream, as
"scope": "gateway": they may include this stream's messages, and nobody can
say which. ndjson shows a loss as a line {"loss": {...}}, SSE as `event:
loss`; raw cannot (its lines are payloads): it is counted only. Its count,
"dropped", is the LossNotice's as the SDK hands it over, with one
translation (`told_count`): a LossNotice's `dropped` of 0 means "how many
is not known" (schema/README.md 5.1 and 7: a notice is sent only for a loss,
so 0 is never a count), and JSON says that as null. So an unknown count
never reads as "none lost", and an exact count is never turned into null.

Event streams come back (decided). A browser's EventSource reconnects by
itself after a stream that ends or a connection that fails, but closes for
good on any status but 200. So a request comes first while the workers
start (a server that restarts): `sdk` waits for them, up to READY_WAIT; and
an event stream that cannot be served (still not ready, a subscribe that
failed, a server shutting down) is answered 200 with `retry:` and an
`event: unavailable` saying why (`httpd.retry_later`), where another format
gets the 503. The HTTP server does the same for a connection over its bound.

SSE ids and resume (decided). An event's id is its position and its stream:
"VB.EPOCH.OFFSET.N.SECRET" (numbers in base 36; N the stream's number, SECRET
16 random bytes, base64url). One id can name one position only, yet a stream
over many vbuckets needs one per vbucket to resume, and carrying them all in
every id would cost up to 1,024 positions per event (and overflow the 8 KiB
head a reconnect sends it back in). So the server keeps, per stream, a
`Ledger`: the positions the stream started from, and the positions of the
last LEDGER_EVENTS events it sent, in order. A reconnect with Last-Event-ID
(or ?last_event_id=) finds the ledger by N, checks SECRET in constant time
(a resume is a capability: ids are never logged), finds the event in the
ledger and subscribes again with `since` = every vbucket's position as of
that event, and `since_time` = when the first stream started for vbuckets it
had not reached; the worker replays the rest from its replay buffer. The
ledger forgets the events after that one (they are sent again) and keeps the
rest: a resume that dies before its first event is sent the same id again
(a browser keeps the last id it got), and the id resolves again. A
resume of a stream the server still writes to ends that stream first (its
client went, unseen). Ledgers outlive their streams by RESUME_WINDOW
seconds, at most MAX_LEDGERS of them (the oldest go first). Ledgers are
the node's own: another node of the cluster does not know the stream (a
resume there is as below), so a reconnect must reach the node that gave
the id, as a load balancer's sticky sessions do. An id the
server cannot use (unknown or expired stream, an event older than its
ledger keeps, a wrong secret) still resumes its own vbucket from its
position, everything else from now, and says so first with an
`event: loss` ("reason": "resume_unknown", "dropped": null): never silently.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import datetime
import itertools
import json
import logging
import math
import os
import time
import urllib.parse
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, cast

from broky.errors import BadPatternError, BrokyError
from broky.matching import MAX_PATTERN_BYTES, parse_pattern
from broky.protocol import (
    Error,
    Goodbye,
    Hello,
    LossReason,
    Message,
    Read,
    ReadDone,
    encode_message,
    new_ksuid,
)
from broky.protocol.frames import Position, encode_read
from broky.protocol.routing import vbucket_of
from broky.server.http.server import (
    EVENT_STREAM,
    SSE_RETRY_MS,
    HttpError,
    HttpServer,
    Request,
    Response,
    Stream,
    quote,
    retry_later,
)

if TYPE_CHECKING:
    import ssl

    from broky.client.client import Client
    from broky.client.connection import WorkerProtocol
    from broky.client.link import WorkerRef
    from broky.client.reader import RangeEnd
    from broky.client.subscription import Subscription
    from broky.server.config import ServerConfig

log = logging.getLogger("broky.master")

PUB = "/v1/pub/"
SUB = "/v1/sub/"
LEDGER_EVENTS = 1024  # positions of a stream's last events kept for a resume
MAX_LEDGERS = 10_000
RESUME_WINDOW = 300.0  # seconds a ledger outlives its stream
KEEPALIVE_SECONDS = 15.0  # an SSE comment (ndjson: nothing) at most this long after the last write
KEEPALIVE = b": keepalive\n\n"
FORMATS = ("ndjson", "raw", "sse")
PROBES = 4096  # Read frames a lane keeps encoded, one per key_partition (then it starts over)
FRAME_OVERHEAD = 128  # bytes of a Message frame besides key, key_partition and payload (at most)
PUBLISH_TIMEOUT = 30.0  # seconds for a POST's messages to be placed and processed (a retry included)
CONNECT_TIMEOUT = 5.0  # seconds to open a lane
RETRY_INTERVAL = 0.2  # seconds between tries to find vbucket's new owner (a POST's second try)
READY_WAIT = 10.0  # seconds a request waits for the workers to be ready (a server that starts)
READY_POLL = 0.05  # seconds between two looks at them meanwhile
END_OF_TIME = (1 << 63) - 1  # a Read's start_time after every message: the vbucket's position only
MAX_ULONG = (1 << 64) - 1  # an epoch or an offset (a Position's ulongs)
MAX_UINT = (1 << 32) - 1  # Subscribe.last
MAX_SINCE_SECONDS = 9_223_372_036  # Subscribe.since_time (ns, a long) holds times before this
# What one stream may hold for its HTTP client (at most --max-pending-bytes): the master's
# memory, which --memory-budget does not count, so smaller than a connection's bound.
STREAM_MAX_PENDING = 1 << 20
# A lagging stream (see "A slow reader lags"): it reads from history once what waits for its
# client is down to max_pending >> LAG_LOW_WATER; at most MAX_READS such reads at once (the
# others wait in line), each holding at most READ_BATCH_MSGS messages before it pauses.
LAG_LOW_WATER = 2
MAX_READS = 8
READ_BATCH_MSGS = 256


@dataclass
class GatewayCounters:
    """Plain integers, read at scrape time."""

    published: int = 0  # messages
    permission_denied: int = 0  # requests of a user outside its permissions (403)
    publish_requests: int = 0  # answered 200
    forwarded: int = 0  # messages published at a worker of another node
    publish_retries: int = 0  # POSTs tried a second time (their vbucket moved, or a node went)
    publish_failed: int = 0  # POSTs answered 503: not all of their messages placed
    streams: int = 0  # open now
    streams_total: int = 0
    delivered: int = 0  # messages written to streams' buffers
    cut_slow: int = 0  # streams cut for their pending bytes (--replay-bytes 0), or a failed read
    lagging: int = 0  # streams lagging now (reading from history)
    lag_entered: int = 0  # times a stream started lagging
    from_history: int = 0  # messages written to lagging streams from history (of `delivered`)
    lag_evicted: int = 0  # messages evicted before a lagging stream read them (told, exact)
    losses_told: int = 0  # loss events written (ndjson, SSE)
    resumed: int = 0  # SSE streams resumed from their ledger
    resume_unknown: int = 0  # Last-Event-IDs the server could not use whole
    retry_later: int = (
        0  # event streams asked to come back: the workers were not ready, or a subscribe failed
    )
    reasons: dict[str, int] = field(default_factory=dict)


def b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    if n == 0:
        return "0"
    out = []
    while n:
        n, r = divmod(n, 36)
        out.append(digits[r])
    return "".join(reversed(out))


class Ledger:
    """What a stream sent, for a resume: where it started, and its last events' positions."""

    def __init__(self, number: int, secret: str, started_ns: int) -> None:
        self.number = number
        self.secret = secret
        self.started_ns = started_ns  # since_time for the vbuckets no event reached
        self.base: dict[int, tuple[int, int]] = {}  # vbucket -> (epoch, offset) before `events`
        self.events: collections.deque[tuple[int, int, int]] = collections.deque()
        self.touched = time.monotonic()
        self.live = False  # a stream writes to it now
        self.owner: SubStream | None = None  # that stream
        self.id_tail = f"{b36(number)}.{secret}".encode()  # its events' ids end so (after id_head)

    def add(self, event: tuple[int, int, int]) -> None:
        """The position (vb, epoch, offset) of an event sent: the gateway's one tuple per
        message, shared by every ledger (see "Formatting once")."""
        events = self.events
        if len(events) >= LEDGER_EVENTS:
            old_vb, old_epoch, old_offset = events.popleft()
            self.base[old_vb] = (old_epoch, old_offset)
        events.append(event)

    def resume_at(self, vb: int, epoch: int, offset: int) -> dict[int, tuple[int, int]] | None:
        """Every vbucket's position as of the event at (vb, epoch, offset), or None: not kept.

        The events after it are forgotten (the client says it did not get them: the resumed
        stream sends them again, and they are added again as it does), the event itself and
        those before it are kept: a resume that dies before its first event is sent the same
        id again, and that id must resolve as often as it is sent."""
        events = self.events
        for i, event in enumerate(events):
            if event == (vb, epoch, offset):
                at = dict(self.base)
                for e_vb, e_epoch, e_offset in itertools.islice(events, i + 1):
                    at[e_vb] = (e_epoch, e_offset)
                for _ in range(len(events) - i - 1):
                    events.pop()
                return at
        return None


def told_count(dropped: int | None) -> int | None:
    """A LossNotice's count as a stream tells it: None (JSON null) when it is not known.

    The protocol says "not known" with a count of 0 (UNACCOUNTED, EPOCH_CHANGED, EVICTED
    from a time: schema/README.md 5.1, 7); a notice is sent only for a loss, so 0 is never
    an exact count. (None, should the SDK hand "unknown" over as None, stays None.)"""
    return dropped or None


def id_head(vb: int, epoch: int, offset: int) -> str:
    """What every stream's id of the event at this position begins with (an id: this, then
    its stream's Ledger.id_tail; decode_id reads it)."""
    return f"{b36(vb)}.{b36(epoch)}.{b36(offset)}."


def decode_id(text: str) -> tuple[int, int, int, int, str] | None:
    """(vb, epoch, offset, stream number, secret) of an event id, or None: not one of ours."""
    parts = text.strip().split(".")
    if len(parts) != 5 or len(text) > 200:
        return None
    try:
        vb, epoch, offset, number = (int(p, 36) for p in parts[:4])
    except ValueError:
        return None
    if not (0 <= vb < 1024 and epoch <= MAX_ULONG and offset <= MAX_ULONG):  # (base 36 has no sign)
        return None
    return vb, epoch, offset, number, parts[4]


class SubStream:
    """One HTTP subscription: the SDK's deliveries formatted into a bounded buffer (httpd.Stream)."""

    def __init__(self, gateway: Gateway, fmt: str, max_pending: int, ledger: Ledger | None) -> None:
        self.gateway = gateway
        self.format = fmt
        self.content_type = {
            "ndjson": "application/x-ndjson",
            "raw": "application/octet-stream",
            "sse": EVENT_STREAM,
        }[fmt]
        self.headers: tuple[tuple[str, str], ...] = ()
        self.max_pending = max_pending
        self.ledger = ledger
        self.parts: list[bytes] = []
        self.pending = 0
        self.ended = False
        self.closed = False
        self.wake = asyncio.Event()
        self.sub: Subscription[Message] | None = None
        self.dropped = 0  # messages not written: the stream was cut for them
        self.idle = False  # nothing written since the gateway's last keepalive tick
        self.user: str | None = None  # the user of its request (--users), and its pattern
        self.pattern = b""
        self.partition: bytes | None = None  # ?partition=
        # Lagging (see "A slow reader lags"): not None from the moment the stream went past
        # max_pending until it is live again. Per vbucket, the position after which its next
        # read starts (the last message it was sent, or read up to), and the position of the
        # last live message it was not sent (what a read goes up to).
        self.lag: dict[int, tuple[int, int]] | None = None
        self.live: dict[int, tuple[int, int]] = {}
        self.pump: asyncio.Task[None] | None = None  # the reads from history
        self.drained = asyncio.Event()  # set each time the client took what waited (`next`)

    # ------------------------------------------------ from the SDK (inline, never blocks)

    def deliver(self, msg: Message) -> None:
        if self.ended:
            self.dropped += 1
            return
        lag = self.lag
        if lag is not None:  # not sent now: read from history later (`catch_up`)
            vb = msg.vbucket
            if vb not in lag:  # the first one of its vbucket not sent: read from just before it
                lag[vb] = (msg.epoch, msg.offset - 1)
            self.live[vb] = (msg.epoch, msg.offset)
            return
        self.write(msg)
        if self.pending > self.max_pending:
            self.over()

    def write(self, msg: Message) -> None:
        """Format `msg` into what waits for the client (live, or read from history)."""
        fmt = self.format
        gateway = self.gateway
        if fmt == "raw":
            data = msg.payload + b"\n"
        else:
            if gateway.formatted is not msg:  # the SDK hands every stream the same Message
                gateway.format(msg)
            if fmt == "ndjson":
                data = gateway.ndjson_line
            else:
                ledger = self.ledger
                assert ledger is not None
                ledger.add(gateway.position)
                data = b"id: %s%s\ndata: %s\n\n" % (gateway.id_head, ledger.id_tail, gateway.json_line)
        gateway.counters.delivered += 1
        self._put(data)

    def over(self) -> None:
        """Past max_pending: lag (read on from history as the client drains), or, with no
        replay buffer to read from (--replay-bytes 0), cut."""
        gateway = self.gateway
        if not gateway.config.replay_bytes:
            self.cut()
            return
        self.lag = {}
        self.live = {}
        gateway.counters.lag_entered += 1
        gateway.counters.lagging += 1
        self.pump = asyncio.get_running_loop().create_task(self.catch_up())

    async def catch_up(self) -> None:
        """Read what the stream was not sent from history, read after read, each once the
        client took what waited, up to the last position sent live when it began; live again
        once a read ends where the live messages stand (no await between that test and the
        switch: no live message falls between them)."""
        gateway = self.gateway
        counters = gateway.counters
        try:
            while True:
                await self.room(self.max_pending >> LAG_LOW_WATER)
                lag, live = self.lag, self.live
                assert lag is not None
                behind = {vb: at for vb, at in live.items() if lag[vb] != at}
                if not behind:
                    self.lag = None
                    self.live = {}
                    counters.lagging -= 1
                    return
                async with gateway.reads:
                    ends = await self.read(lag, behind)
                evicted, changed = 0, False
                for vb, end in ends.items():
                    lag[vb] = (end.epoch, end.next - 1)
                    if live.get(vb) == behind.get(vb):  # nothing live since: caught up
                        live[vb] = lag[vb]
                    evicted += end.evicted
                    changed = changed or end.epoch_changed
                if changed:  # what followed the position in its epoch: how much, nobody knows
                    self.loss(None, LossReason.name(LossReason.EPOCH_CHANGED), "stream")
                if evicted:
                    counters.lag_evicted += evicted
                    self.loss(evicted, LossReason.name(LossReason.EVICTED), "stream")
        except (BrokyError, OSError) as exc:
            self.cut(f"reading what it missed from history failed: {exc}")
        finally:
            if self.lag is not None:
                self.lag = None
                counters.lagging -= 1

    async def read(
        self, lag: dict[int, tuple[int, int]], behind: dict[int, tuple[int, int]]
    ) -> dict[int, RangeEnd]:
        """One read from history: of the vbuckets `behind`, after their `lag` positions up to
        their `behind` ones, formatted in as the client takes what waits; each vbucket's
        RangeEnd (where it ended, what was evicted)."""
        from broky.client.reader import Reading  # the SDK: loaded at the first /v1/ request

        client = self.gateway.client
        if client is None or client.is_closed:
            raise BrokyError("the server's client of its workers is closed")
        reading = Reading(
            client,
            self.pattern,
            self.partition,
            start=tuple(Position(vb, *lag[vb]) for vb in sorted(behind)),
            stop=tuple(Position(vb, *at) for vb, at in sorted(behind.items())),
            vbuckets=frozenset(behind),
            max_pending_msgs=READ_BATCH_MSGS,
        )
        counters = self.gateway.counters
        room = self.max_pending >> LAG_LOW_WATER
        async with contextlib.aclosing(cast(AsyncGenerator[Message, None], reading.stream())) as messages:
            async for msg in messages:
                if self.pending > self.max_pending:
                    await self.room(room)  # the read's connections pause meanwhile
                self.write(msg)
                counters.from_history += 1
        return reading.ends

    async def room(self, low: int) -> None:
        """Until what waits for the client is down to `low` bytes."""
        while self.pending > low:
            self.drained.clear()
            await self.drained.wait()

    def loss(self, dropped: int | None, reason: str, scope: str) -> None:
        """Tell the client of a loss (ndjson, SSE; raw: counted only)."""
        counters = self.gateway.counters
        counters.reasons[reason] = counters.reasons.get(reason, 0) + 1
        if self.ended or self.format == "raw":
            return
        counters.losses_told += 1
        body = json.dumps({"dropped": dropped, "reason": reason, "scope": scope})
        if self.format == "ndjson":
            self._put(f'{{"loss":{body}}}\n'.encode())
        else:
            self._put(f"event: loss\ndata: {body}\n\n".encode())

    def cut(self, error: str | None = None) -> None:
        """Past max_pending (--replay-bytes 0), or a read from history failed (`error`):
        drop what waits, say so, end."""
        self.gateway.counters.cut_slow += 1
        self.dropped += 1
        told: dict[str, Any] = {
            "reason": "slow_consumer",
            "pending_bytes": self.pending,
            "limit": self.max_pending,
        }
        if error is not None:
            told["error"] = error
        body = json.dumps(told)
        self.parts.clear()
        self.pending = 0
        if self.format == "sse":
            self._put(f"event: cut\ndata: {body}\n\n".encode())
        elif self.format == "ndjson":
            self._put(f'{{"cut":{body}}}\n'.encode())
        self.end()

    def deny(self, why: str) -> None:
        """A reload of the users refuses this stream's pattern: say so (ndjson, SSE), end."""
        body = json.dumps({"reason": "PERMISSION_DENIED", "message": why})
        if self.format == "sse":
            self._put(f"event: denied\ndata: {body}\n\n".encode())
        elif self.format == "ndjson":
            self._put(f'{{"denied":{body}}}\n'.encode())
        self.end()

    def _put(self, data: bytes) -> None:
        self.parts.append(data)
        self.pending += len(data)
        if len(self.parts) == 1:
            self.wake.set()

    def end(self) -> None:
        self.ended = True
        self.wake.set()
        self._unsubscribe()
        self._stop_pump()

    def _stop_pump(self) -> None:
        pump, self.pump = self.pump, None
        if pump is not None and pump is not asyncio.current_task():
            pump.cancel()  # (its read's connections close with it)

    # ------------------------------------------------ to httpd (httpd.Stream)

    async def next(self) -> bytes | None:
        while not self.parts:
            if self.ended or self.closed:
                return None
            self.wake.clear()
            await self.wake.wait()  # (no timeout of its own: see "Keepalives")
        data = b"".join(self.parts)
        self.parts.clear()
        self.pending = 0
        self.idle = False
        self.drained.set()
        return data

    def keepalive(self) -> None:
        """The gateway's tick: a comment when nothing was written since the tick before."""
        if self.idle and not self.ended:
            self._put(KEEPALIVE)
        self.idle = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ended = True
        self.wake.set()
        self._unsubscribe()
        self._stop_pump()
        self.gateway.stream_closed(self)

    def _unsubscribe(self) -> None:
        sub, self.sub = self.sub, None
        if sub is not None and not self.gateway.closing:
            self.gateway.background(sub.unsubscribe())


def _as_json(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"key": _text(msg.key), "key_partition": _text(msg.key_partition)}
    try:
        out["payload"] = msg.payload.decode()
    except UnicodeDecodeError:
        out["payload_base64"] = base64.b64encode(msg.payload).decode()
    # The epoch and ts_broker as decimal strings: 64-bit numbers past JavaScript's exact
    # integers (2**53), which JSON.parse would round (ts_broker to about 256 ns).
    out["vbucket"], out["epoch"], out["offset"] = msg.vbucket, str(msg.epoch), msg.offset
    out["ts_broker"] = str(msg.ts_broker)
    if msg.uid is not None:
        out["uid"] = msg.uid_text
    return out


def _position(vb: int, epoch: int, offset: int) -> list[Any]:
    """A position in JSON: the epoch as a decimal string (it exceeds 2**53, JavaScript's exact
    integers)."""
    return [vb, str(epoch), offset]


def _answer(vb: int, n: int, batches: list[Batch]) -> dict[str, Any]:
    """The answer to a POST whose n messages `batches` placed (answered whole, in order).

    Exact when each batch's messages took consecutive offsets between its two Reads
    (nobody else published to vb meanwhile) and each batch went on where the one
    before it stopped (a move continues the sequence at the new owner); else the
    bounds the messages lie within, when both ends are known."""
    answer: dict[str, Any] = {"published": n, "vbucket": vb}
    placed = [batch for batch in batches if batch.accepted]
    spans = [(batch.probes[0], batch.probes[1]) for batch in placed]  # the Reads' answers
    known = all(isinstance(b, ReadDone) and isinstance(a, ReadDone) for b, a in spans)
    exact = n > 0 and known
    if exact:
        prev: ReadDone | None = None
        for batch, (before, after) in zip(placed, spans, strict=True):
            assert isinstance(before, ReadDone) and isinstance(after, ReadDone)
            if after.epoch != before.epoch or after.next - before.next != batch.accepted:
                exact = False
            if prev is not None and (before.epoch != prev.epoch or before.next != prev.next):
                exact = False
            prev = after
    answer["exact"] = exact
    if not n:
        return answer
    first, last = spans[0][0], spans[-1][1]
    if exact:
        assert isinstance(first, ReadDone) and isinstance(last, ReadDone)
        answer["first"] = _position(vb, first.epoch, first.next)
        answer["last"] = _position(vb, last.epoch, last.next - 1)
        return answer
    # others published to the vbucket meanwhile (or its epoch changed): the bounds, if known
    answer["first"] = answer["last"] = None
    if isinstance(first, ReadDone) and isinstance(last, ReadDone):
        answer["after"] = _position(vb, first.epoch, first.next - 1)
        answer["at_most"] = _position(vb, last.epoch, last.next - 1)
    return answer


def _text(data: bytes) -> str:
    return data.decode(errors="backslashreplace")


def _encode(key_partition: bytes, key: bytes, payload: bytes, ts_producer: int, uid: bytes) -> bytes:
    """A Message frame, as the SDK's compiled `encode` makes it (without the twin)."""
    return encode_message(key_partition, key, payload, ts_producer, uid=uid)


class Batch:
    """One POST's messages on a lane, and what the worker answered about them: its two
    Reads' answers (a ReadDone, or an Error naming the read), in order, and between
    them the messages it refused (NOT_MY_VBUCKET carries each back) or failed."""

    __slots__ = ("frames", "probes", "refused", "errors", "done")

    def __init__(self, frames: list[bytes], done: asyncio.Future[None]) -> None:
        self.frames = frames  # the Message frames, as written (a resend sends these again)
        self.probes: list[ReadDone | Error] = []
        self.refused: list[bytes] = []  # frames the worker refused, in order
        self.errors: list[str] = []  # other refusals of its messages (none expected)
        self.done = done

    @property
    def accepted(self) -> int:
        return len(self.frames) - len(self.refused)


class Lane:
    """The gateway's publish connection to one worker (a connection.Handler): a POST's Read,
    its messages and a second Read go out in one write, and the two ReadDones say where the
    vbucket stood before and after (see the theory of operation). A worker handles one
    connection's frames in order, so its answers come in the order of the frames: the
    answer to a Read (ReadDone, or an Error with the rid) goes to the oldest batch still
    waiting, an answer to a message (a refusal) to the oldest batch, which then has its
    first Read's answer and not its second; every Read can carry the same rid (its frame
    is cached)."""

    def __init__(self, node_id: str, worker: int) -> None:
        self.node_id = node_id
        self.worker = worker
        self.proto: WorkerProtocol | None = None
        self.waiting: collections.deque[Batch] = collections.deque()
        self.probes: dict[bytes, bytes] = {}  # key_partition -> its Read frame (bounded: PROBES)

    def __str__(self) -> str:
        return f"worker {self.worker} of node {self.node_id!r}"

    def on_message(self, msg: Message) -> None:  # a publish connection subscribes to nothing
        pass

    def on_frame(self, frame: Any) -> None:
        waiting = self.waiting
        if isinstance(frame, ReadDone) or (isinstance(frame, Error) and frame.rid and not frame.fatal):
            if waiting:
                batch = waiting[0]
                batch.probes.append(frame)
                if len(batch.probes) == 2:
                    waiting.popleft()
                    if not batch.done.done():
                        batch.done.set_result(None)
        elif isinstance(frame, Error):
            if frame.fatal:
                self.fail(BrokyError(f"{self} closed the connection: {frame.message or frame.code}"))
            elif waiting and frame.refused is not None:  # NOT_MY_VBUCKET: the message, back
                waiting[0].refused.append(frame.refused)
            elif waiting:
                waiting[0].errors.append(frame.message or str(frame.code))
        elif isinstance(frame, Goodbye):  # the node leaves: what follows is not processed
            self.fail(BrokyError(f"{self} said Goodbye ({frame.reason or 'leaving'})"))

    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None:
        self.fail(BrokyError(f"the connection to {self} was lost{f': {exc}' if exc else ''}"))

    def fail(self, exc: BaseException) -> None:
        waiting, self.waiting = self.waiting, collections.deque()
        for batch in waiting:
            if not batch.done.done():
                batch.done.set_exception(exc)
        if self.proto is not None:
            self.proto.close()
            self.proto = None

    async def publish(self, partition: bytes, vb: int, frames: list[bytes], timeout: float) -> Batch:
        """Write the messages between two Reads of vb; the Batch once both Reads are answered.

        Raises:
            BrokyError: the connection was lost (or closed, or said Goodbye), or the worker
                did not answer within `timeout`: which of the messages it took is unknown.
        """
        proto = self.proto
        if proto is None:
            raise BrokyError(f"the connection to {self} was lost")
        probe = self.probes.get(partition)
        if probe is None:
            if len(self.probes) >= PROBES:
                self.probes.clear()
            probe = self.probes[partition] = encode_read(
                Read(1, b">", partition, start_time=END_OF_TIME, vbuckets=(vb,))
            )
        batch = Batch(frames, asyncio.get_running_loop().create_future())
        self.waiting.append(batch)
        proto.writelines([probe, *frames, probe])
        try:
            async with asyncio.timeout(timeout):
                await batch.done
        except TimeoutError:
            why = f"{self} did not answer within {timeout:.3g} s"
            self.fail(BrokyError(why))
            raise BrokyError(why) from None
        return batch


class Gateway:
    """The /v1/ routes on the master's HTTP server, with the master's SDK client."""

    def __init__(
        self, http: HttpServer, config: ServerConfig, ready: Callable[[], bool], connect_host: str
    ) -> None:
        self.http = http
        self.config = config
        self.ready = ready
        self.connect_host = connect_host
        self.client: Client | None = None
        self._connecting = asyncio.Lock()
        self.lanes: dict[tuple[str, int], Lane] = {}  # (node id, worker) -> its publish lane
        self._opening: dict[tuple[str, int], asyncio.Task[Lane]] = {}  # lanes being opened
        self.encode: Callable[[bytes, bytes, bytes, int, bytes], bytes] | None = None  # a Message frame
        self.counters = GatewayCounters()
        self.streams: set[SubStream] = set()
        self.reads = asyncio.Semaphore(MAX_READS)  # lagging streams' reads from history, in line
        self.ledgers: collections.OrderedDict[int, Ledger] = collections.OrderedDict()
        self._numbers = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closing = False
        self.ticking = False  # the keepalive tick runs (from the first SSE stream on)
        # The last Message formatted for the streams (see "Formatting once"), and its forms.
        self.formatted: Message | None = None
        self.json_line = b""
        self.ndjson_line = b""
        self.id_head = b""
        self.position = (0, 0, 0)

    def install(self) -> None:
        methods = ("POST",)
        self.http.route(PUB, self.publish, private=True, methods=methods, prefix=True, browser=True)
        self.http.route(SUB, self.subscribe, private=True, prefix=True, browser=True)

    async def close(self) -> None:
        """End every stream cleanly, close the client (before the workers stop)."""
        self.closing = True
        for stream in list(self.streams):
            stream.end()
        await asyncio.sleep(0)  # let the writers take their ends
        for lane in self.lanes.values():
            lane.fail(BrokyError("the server is shutting down"))
        client, self.client = self.client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 3.0)
            except (BrokyError, TimeoutError, OSError):
                pass
        for task in list(self._tasks):
            task.cancel()

    def background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("gateway task failed: %r", task.exception())

    async def sdk(self) -> Client:
        """The master's client of its own workers (connected once, when they are ready: a
        request that comes first, as when a server starts, waits up to READY_WAIT for them).

        Raises:
            HttpError: 503 when the workers are still not ready, or the connection fails.
        """
        client = self.client
        if client is not None and not client.is_closed:
            return client
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_WAIT
        while not self.ready() or self.closing:
            if self.closing:
                raise HttpError(503, "the server is shutting down")
            if loop.time() >= deadline:
                raise HttpError(
                    503, f"the workers are not ready after {READY_WAIT:g} s; try again in a moment"
                )
            await asyncio.sleep(READY_POLL)
        async with self._connecting:
            if self.client is not None and not self.client.is_closed:
                return self.client
            from broky.client.client import Client

            cfg = self.config
            client = Client(
                f"{self.connect_host}:{cfg.port}",
                name="http-gateway",
                auth_token=cfg.auth_token,
                ssl_context=self._tls(),
                on_loss=self._connection_loss,
                on_error=self._error,
            )
            try:
                await client.connect()
            except (BrokyError, OSError) as exc:
                raise HttpError(503, f"cannot reach the workers: {exc}") from None
            self.client = client
            return client

    def format(self, msg: Message) -> None:
        """`msg` as every ndjson and SSE stream sends it (see "Formatting once")."""
        line = json.dumps(_as_json(msg), separators=(",", ":")).encode()
        self.formatted = msg
        self.json_line = line
        self.ndjson_line = line + b"\n"
        self.id_head = id_head(msg.vbucket, msg.epoch, msg.offset).encode()
        self.position = (msg.vbucket, msg.epoch, msg.offset)

    async def _keepalives(self) -> None:
        """Every KEEPALIVE_SECONDS / 2, each SSE stream's `keepalive` (see "Keepalives")."""
        while not self.closing:
            await asyncio.sleep(KEEPALIVE_SECONDS / 2)
            for stream in list(self.streams):
                if stream.format == "sse":
                    stream.keepalive()

    def _tls(self) -> ssl.SSLContext | None:
        """A TLS server's gateway connects to its own workers with TLS too (they require
        it): it checks no certificate (it dials its own port), and under mutual TLS it
        presents the server's certificate, which must then chain to --tls-ca."""
        cfg = self.config
        if not cfg.tls_cert or cfg.tls_allow_plain:
            return None
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if cfg.tls_verify_clients:
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        return ctx

    def _connection_loss(self, ref: WorkerRef, dropped: int, reason: int) -> None:
        name = LossReason.name(reason)
        for stream in list(self.streams):
            stream.loss(told_count(dropped), name, "gateway")

    def _error(self, exc: BaseException) -> None:
        log.debug("gateway client: %s", exc)

    # ------------------------------------------------------------ publish

    def apply_users(self) -> None:
        """The users were reloaded (SIGHUP): end each stream its user may no longer hold."""
        for stream in list(self.streams):
            if stream.user is not None and not stream.ended:
                why = self.why_not(stream.user, sub=stream.pattern)
                if why is not None:
                    self.counters.permission_denied += 1
                    stream.deny(f"user {stream.user!r}: subscription ended by a reload: {why}")

    def refusal(self, request: Request, pub: bytes | None = None, sub: bytes | None = None) -> None:
        """A request of a user (Basic credentials, --users) outside its permissions: 403."""
        if request.user is None:
            return
        why = self.why_not(request.user, pub, sub)
        if why is not None:
            self.counters.permission_denied += 1
            raise HttpError(403, f"PERMISSION_DENIED: user {request.user!r}: {why}")

    def why_not(self, name: str, pub: bytes | None = None, sub: bytes | None = None) -> str | None:
        """Why user `name` may not publish `pub` (or subscribe to `sub`) here; None: it may."""
        users = self.http.users()
        user = None if users is None else users.by_name.get(name)
        if user is None:
            why: str | None = "the user is gone from the users file"
        elif not user.http:
            why = "may not use the HTTP gateway"
        elif pub is not None:
            why = user.publish.key_refusal(pub)
        else:
            assert sub is not None
            why = user.subscribe.pattern_refusal(sub)
        return why

    async def publish(self, request: Request) -> Response:
        key = urllib.parse.unquote_to_bytes(request.path[len(PUB) :])
        if not key:
            raise_bad("the key is missing: POST /v1/pub/KEY")
        self.refusal(request, pub=key)
        query = request.query
        partition = query["partition"].encode() if "partition" in query else key
        if not partition:
            raise_bad("an empty partition: give ?partition=P, or leave it out (the key is the partition)")
        lines = query.get("lines", "1")
        if lines not in ("0", "1"):
            raise_bad(f"lines must be 0 (the body is one message) or 1 (one per line), not {quote(lines)}")
        body = request.body
        if lines == "0":
            payloads = [body]
        else:
            payloads = body.split(b"\n")
            if payloads and not payloads[-1]:
                payloads.pop()
        n = len(payloads)
        client = await self.sdk()
        info = client.server_info
        assert info is not None
        room = info.max_frame_bytes - FRAME_OVERHEAD - len(key) - len(partition)
        largest = max(map(len, payloads), default=0)
        if largest > room:
            raise HttpError(
                413,
                f"a message of {largest} bytes: at most {room} fit in a frame (--max-frame-bytes)",
            )
        if self.encode is None:
            from broky.client import pubpack  # the SDK: loaded at the first /v1/ request

            self.encode = _encode if pubpack.compiled is None else pubpack.compiled.encode
        encode = self.encode
        now = time.time_ns()
        frames = [encode(partition, key, payload, now, new_ksuid()) for payload in payloads]
        vb = vbucket_of(partition)
        answer = await self._place(client, partition, vb, frames)
        self.counters.publish_requests += 1
        self.counters.published += n
        return 200, "application/json", (json.dumps(answer) + "\n").encode()

    async def _place(self, client: Client, partition: bytes, vb: int, frames: list[bytes]) -> dict[str, Any]:
        """Publish `frames` at the owner of vb, whichever node it is on; the JSON answer.

        A second try, once, within the request's PUBLISH_TIMEOUT, for what the first
        could not place: the messages the worker refused (vb moved: NOT_MY_VBUCKET
        carries each back, in order), or all of them when the lane was lost (the node
        went or left; which ones it took is unknown: they go again, with their uids).
        Before it, the map is refreshed until it names an owner that takes them.

        Raises:
            HttpError: 503, saying why the messages could not be placed.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUBLISH_TIMEOUT
        n = len(frames)
        done: list[Batch] = []  # batches the worker answered whole, in order
        owner = self._owner(client, vb)
        refused_by: tuple[str, int] | None = None
        try:
            lane = await self._lane(client, owner, deadline)
        except BrokyError as exc:  # nothing written
            resend, unsure, why = frames, False, str(exc)
        else:
            try:
                batch = await lane.publish(partition, vb, frames, deadline - loop.time())
            except BrokyError as exc:
                resend, unsure, why = frames, True, str(exc)
            else:
                self._count(lane, batch)
                if batch.errors:
                    self._failed(f"{lane} refused: {batch.errors[0]}", batch.accepted)
                if not batch.refused:
                    return _answer(vb, n, [batch])
                done.append(batch)
                resend, unsure, refused_by = batch.refused, False, owner
                why = f"{lane} no longer owns vbucket {vb} (it moved)"
        self.counters.publish_retries += 1
        try:
            lane = await self._relocate(client, vb, refused_by, deadline)
            batch = await lane.publish(partition, vb, resend, deadline - loop.time())
        except BrokyError as exc:
            published = None if unsure else sum(b.accepted for b in done)
            self._failed(f"{why}; then {exc}", published)
        self._count(lane, batch)
        if batch.errors or batch.refused:
            problem = batch.errors[0] if batch.errors else f"it does not own vbucket {vb} either"
            self._failed(f"{why}; then {lane} refused: {problem}", sum(b.accepted for b in (*done, batch)))
        done.append(batch)
        answer = _answer(vb, n, done)
        answer["resent"] = {"messages": len(resend), "why": why, "maybe_twice": unsure}
        return answer

    def _count(self, lane: Lane, batch: Batch) -> None:
        if lane.node_id != self.config.node_id:
            self.counters.forwarded += batch.accepted

    def _failed(self, why: str, published: int | None) -> NoReturn:
        """503: the messages could not all be placed; `published`: how many were (None: unknown)."""
        self.counters.publish_failed += 1
        if published:
            self.counters.published += published
        raise HttpError(503, f"publish failed: {why}", fields={"published": published})

    def _owner(self, client: Client, vb: int) -> tuple[str, int]:
        """(node id, worker) of vb's owner in the client's map."""
        info = client.server_info
        assert info is not None
        node, worker = info.map.owners[vb]
        return info.map.nodes[node].node_id, worker

    async def _relocate(
        self, client: Client, vb: int, refused_by: tuple[str, int] | None, deadline: float
    ) -> Lane:
        """The lane of vb's owner once the map, refreshed, names one that answers (and
        not `refused_by`, the worker that refused them), tried every RETRY_INTERVAL.

        Raises:
            BrokyError: none before the deadline (why: the last attempt's reason).
        """
        loop = asyncio.get_running_loop()
        why = "no time was left"
        while (left := deadline - loop.time()) > 0:
            if self.closing:
                raise BrokyError("the server is shutting down")
            try:
                async with asyncio.timeout(left):
                    await client.refresh_map()
            except (BrokyError, TimeoutError) as exc:
                why = f"the map could not be refreshed: {exc}"
            owner = self._owner(client, vb)
            if owner == refused_by:
                why = f"the map still names worker {owner[1]} of node {owner[0]!r}, which refused them"
            else:
                try:
                    return await self._lane(client, owner, deadline)
                except BrokyError as exc:
                    why = str(exc)
            await asyncio.sleep(min(RETRY_INTERVAL, max(deadline - loop.time(), 0)))
        raise BrokyError(f"no owner of vbucket {vb} took them within {PUBLISH_TIMEOUT:g} s ({why})")

    async def _lane(self, client: Client, owner: tuple[str, int], deadline: float) -> Lane:
        """The lane of `owner` (node id, worker): open, or opened now (once for every POST
        that needs it meanwhile).

        Raises:
            BrokyError: it cannot be reached before the deadline (or CONNECT_TIMEOUT).
        """
        lane = self.lanes.get(owner)
        if lane is not None and lane.proto is not None:
            return lane
        opening = self._opening.get(owner)
        if opening is None:
            opening = self._opening[owner] = asyncio.get_running_loop().create_task(
                self._open_lane(client, owner)
            )
            opening.add_done_callback(lambda task: self._opened(owner, task))
        try:
            async with asyncio.timeout(deadline - asyncio.get_running_loop().time()):
                return await asyncio.shield(opening)
        except TimeoutError:
            raise BrokyError(f"worker {owner[1]} of node {owner[0]!r} did not answer in time") from None

    def _opened(self, owner: tuple[str, int], task: asyncio.Task[Lane]) -> None:
        self._opening.pop(owner, None)
        if not task.cancelled() and task.exception() is None:
            lane = self.lanes[owner] = task.result()
            if self.closing:  # opened while the server shut down: its POSTs fail
                lane.fail(BrokyError("the server is shutting down"))

    async def _open_lane(self, client: Client, owner: tuple[str, int]) -> Lane:
        from broky.client.connection import open_connection  # the SDK: loaded at the first /v1/ request

        node_id, worker = owner
        lane = Lane(node_id, worker)
        host, port = client.address_of(node_id)
        hello = Hello(worker=worker, client_name="http-gateway-pub", auth_token=self.config.auth_token)
        try:
            lane.proto, _ = await open_connection(host, port, hello, CONNECT_TIMEOUT, tls=client.tls)
        except (BrokyError, OSError) as exc:
            raise BrokyError(f"cannot reach {lane} at {host}:{port}: {exc}") from None
        lane.proto.attach(lane)
        return lane

    # ------------------------------------------------------------ subscribe

    async def subscribe(self, request: Request) -> Response | Stream:
        pattern = urllib.parse.unquote_to_bytes(request.path[len(SUB) :])
        try:
            parse_pattern(pattern)
        except BadPatternError:
            raise_bad(f"bad pattern {quote(pattern)}: {_pattern_problem(pattern)}")
        self.refusal(request, sub=pattern)
        query = request.query
        fmt = query.get("format")
        if fmt is None:
            fmt = "sse" if "text/event-stream" in request.headers.get("accept", "") else "ndjson"
        if fmt not in FORMATS:
            raise_bad(f"format must be one of {', '.join(FORMATS)}, not {quote(fmt)}")
        partition = query["partition"].encode() if "partition" in query else None
        last = _count(query, "last")
        since_time = _time(query.get("since_time"))
        last_id = request.headers.get("last-event-id") or query.get("last_event_id")
        if last_id is not None and fmt != "sse":
            raise_bad("Last-Event-ID (or ?last_event_id=) resumes an event stream (format=sse) only")
        try:
            client = await self.sdk()
        except HttpError as exc:
            if fmt == "sse" and exc.status == 503:  # a browser's EventSource must come back
                return self._retry_later(exc.message)
            raise
        started_ns = since_time if since_time is not None else time.time_ns()
        since: list[Position] = []
        ledger: Ledger | None = None
        told_unknown = False
        if fmt == "sse":
            if last_id is not None:
                ledger, since, told_unknown = self._resume(last_id)
                if ledger is not None:
                    started_ns = ledger.started_ns
                last = 0
                since_time = started_ns
            if ledger is None:
                ledger = self._new_ledger(started_ns)
            ledger.live = True
        bound = min(self.config.max_pending_bytes, STREAM_MAX_PENDING)
        stream = SubStream(self, fmt, bound, ledger)
        stream.user, stream.pattern = request.user, pattern  # (a reload of the users re-checks them)
        stream.partition = partition  # (and a lagging stream's reads from history read them)
        if fmt == "sse":
            stream._put(f"retry: {SSE_RETRY_MS}\n\n".encode())
            if told_unknown:
                stream.loss(None, "resume_unknown", "stream")
        try:
            stream.sub = await client.subscribe(
                pattern,
                partition=partition,
                callback=stream.deliver,
                since=since,
                since_time=since_time,
                last=last,
                on_loss=lambda dropped, reason: stream.loss(
                    told_count(dropped), LossReason.name(reason), "stream"
                ),
            )
        except BrokyError as exc:
            if ledger is not None:
                ledger.live = False
            if fmt == "sse":
                return self._retry_later(f"subscribe failed: {exc}")
            raise HttpError(503, f"subscribe failed: {exc}") from None
        if ledger is not None:
            ledger.owner = stream
        if fmt == "sse" and not self.ticking:
            self.ticking = True
            self.background(self._keepalives())
        self.streams.add(stream)
        self.counters.streams += 1
        self.counters.streams_total += 1
        return stream

    def _retry_later(self, why: str) -> Response:
        """An event stream's request that cannot be served now (503 to other formats): a
        stream that asks its client to come back (`retry_later`). Its Last-Event-ID, if any,
        resolves again next time."""
        self.counters.retry_later += 1
        return 200, EVENT_STREAM, retry_later(why)

    def stream_closed(self, stream: SubStream) -> None:
        if stream in self.streams:
            self.streams.discard(stream)
            self.counters.streams -= 1
        if stream.ledger is not None and stream.ledger.owner in (stream, None):
            stream.ledger.live = False
            stream.ledger.owner = None
            stream.ledger.touched = time.monotonic()

    def _new_ledger(self, started_ns: int) -> Ledger:
        self._expire()
        number = next(self._numbers)
        secret = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        ledger = self.ledgers[number] = Ledger(number, secret, started_ns)
        return ledger

    def _expire(self) -> None:
        now = time.monotonic()
        ledgers = self.ledgers
        for number in [n for n, led in ledgers.items() if not led.live and now - led.touched > RESUME_WINDOW]:
            del ledgers[number]
        while len(ledgers) >= MAX_LEDGERS:
            ledgers.popitem(last=False)

    def _resume(self, last_id: str) -> tuple[Ledger | None, list[Position], bool]:
        """(the stream's ledger, `since`, whether the id could not be used whole)."""
        decoded = decode_id(last_id)
        if decoded is None:
            raise_bad(f"Last-Event-ID {quote(last_id)} is not an id this server gave")
        vb, epoch, offset, number, secret = decoded
        import hmac  # here, as in broky.server.http.server: only a resume needs it

        ledger = self.ledgers.get(number)
        at = None
        if ledger is not None and hmac.compare_digest(secret.encode(), ledger.secret.encode()):
            if ledger.owner is not None:  # its stream is still open (its client's going went unseen)
                ledger.owner.close()
            at = ledger.resume_at(vb, epoch, offset)
        else:
            ledger = None
        if at is None:  # resume its own vbucket; the rest from now, told
            self.counters.resume_unknown += 1
            return None, [Position(vb, epoch, offset)], True
        assert ledger is not None
        self.counters.resumed += 1
        self.ledgers.move_to_end(number)
        return ledger, [Position(v, e, o) for v, (e, o) in sorted(at.items())], False


def _pattern_problem(pattern: bytes) -> str:
    """What is wrong with a pattern parse_pattern refused, in words for an HTTP client."""
    if not pattern:
        return "the pattern is empty: GET /v1/sub/PATTERN"
    if len(pattern) > MAX_PATTERN_BYTES:
        return f"longer than {MAX_PATTERN_BYTES} bytes"
    tokens = pattern.split(b".")
    if not all(tokens):
        return "an empty token (two dots in a row, or a dot at either end)"
    if b">" in tokens[:-1]:
        return "'>' may only be the last token"
    return "a wildcard inside a token: '*' and '>' stand alone between dots"


def raise_bad(message: str) -> NoReturn:
    raise HttpError(400, message)


def _count(query: dict[str, str], name: str) -> int:
    """A count of the query (0 when absent): at most MAX_UINT, what Subscribe.last holds."""
    raw = query.get(name)
    if raw is None:
        return 0
    if not raw.isascii() or not raw.isdigit() or len(raw) > 10 or int(raw) > MAX_UINT:
        raise_bad(f"{name} must be a count (0 .. {MAX_UINT}), not {quote(raw)}")
    return int(raw)


def _time(raw: str | None) -> int | None:
    """?since_time=: seconds since the epoch (a number), or an ISO 8601 time with its zone; ns,
    from 1970 on and within Subscribe.since_time (a signed 64-bit count of ns: before 2262)."""
    if raw is None:
        return None
    try:
        seconds: float | None = float(raw)
    except ValueError:
        try:
            when = datetime.datetime.fromisoformat(raw)
        except ValueError:
            when = None
        seconds = when.timestamp() if when is not None and when.tzinfo is not None else None
    if seconds is None or not math.isfinite(seconds):
        raise_bad(
            f"since_time must be seconds since the epoch or an ISO 8601 time with a zone, not {quote(raw)}"
        )
    if not 0 <= seconds < MAX_SINCE_SECONDS:
        raise_bad(
            f"since_time {quote(raw)} is out of range: from 1970-01-01T00:00:00Z (0) to "
            f"2262-04-11T23:47:16Z ({MAX_SINCE_SECONDS}: nanoseconds since the epoch in 64 bits)"
        )
    return int(seconds * 1e9)


def install(master: Any) -> Gateway:
    """Register the /v1/ routes on the master's HTTP server."""

    def ready() -> bool:
        sup = master.supervisor
        return sup is not None and all(wp is not None and wp.ready and not wp.gone for wp in sup.workers)

    cfg = master.config
    host = cfg.host if cfg.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    gateway = Gateway(master.http, cfg, ready, host)
    gateway.install()
    return gateway
