"""The HTTP way in: publish with a POST, subscribe as a stream (ndjson, raw, Server-Sent Events).

Theory of operation
-------------------
Routes (registered on the master's HttpServer, broky.server.httpd, all under
/v1/, all `private`: with an --auth-token they need it, as a Bearer header, the
broky_token cookie or ?access_token=; with --users, a user's Basic credentials
do too, and the request acts as that user: `refusal` answers 403 for a key or
pattern outside its permissions, or for a user with `http = false`):

    POST /v1/pub/KEY?partition=P[&lines=0]   publish; JSON answer
    GET  /v1/sub/PATTERN?format=ndjson|raw|sse[&partition=P][&since_time=T][&last=N]
                                             a stream, chunked; SSE also when the
                                             request says Accept: text/event-stream

How a request reaches the workers (decided). The master holds one SDK
`Client` connected to its own workers (`sdk`, connected at the first /v1/
request, once, and kept; broky.client is loaded only then): a subscription
is one SDK subscription with an inline callback that appends to the
stream's buffer. A publish goes through a `Lane`: one connection per worker
(opened at its first POST, with Hello.worker, and kept), on which the POST's
messages go straight to the worker that owns the partition's vbucket, in
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

Publish. The body is split on LF (a CR before it is kept: bytes are bytes),
an empty last line dropped; `?lines=0` takes the whole body as one message.
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
and at most --http-max-connections streams hold it): past it the stream is
cut (`cut_slow`, counted), after a last line saying so (SSE `event: cut`),
so a reader that cannot keep up is told and closed like any slow consumer,
and the SDK connection it shares is never paused for it.

Losses the server tells: those naming the stream's subscription (a start
that asked for what is no longer retained: EVICTED, EPOCH_CHANGED) go to
that stream only; those of the gateway's connection to
a worker (sid 0: SLOW_CONSUMER, CONNECTION_LOST, ...) go to every stream, as
"scope": "gateway": they may include this stream's messages, and nobody can
say which. ndjson shows a loss as a line {"loss": {...}}, SSE as `event:
loss`; raw cannot (its lines are payloads): it is counted only.

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
had not reached; the worker replays the rest from its replay buffer. A
resume of a stream the server still writes to ends that stream first (its
client went, unseen). Ledgers outlive their streams by RESUME_WINDOW
seconds, at most MAX_LEDGERS of them (the oldest go first). An id the
server cannot use (unknown or expired stream, an event older than its
ledger keeps, a wrong secret) still resumes its own vbucket from its
position, everything else from now, and says so first with an
`event: loss` ("reason": "resume_unknown", "dropped": null): never silently.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime
import itertools
import json
import logging
import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from broky.errors import BadPatternError, BrokyError
from broky.matching import MAX_PATTERN_BYTES, parse_pattern
from broky.protocol import Error, Hello, LossReason, Message, Read, ReadDone, encode_message, new_ksuid
from broky.protocol.frames import Position, encode_read
from broky.protocol.routing import vbucket_of
from broky.server.httpd import HttpError, HttpServer, Request, Response, Stream, quote

if TYPE_CHECKING:
    import ssl

    from broky.client.client import Client
    from broky.client.connection import WorkerProtocol
    from broky.client.link import WorkerRef
    from broky.client.subscription import Subscription
    from broky.server.config import ServerConfig

log = logging.getLogger("broky.master")

PUB = "/v1/pub/"
SUB = "/v1/sub/"
LEDGER_EVENTS = 1024  # positions of a stream's last events kept for a resume
MAX_LEDGERS = 10_000
RESUME_WINDOW = 300.0  # seconds a ledger outlives its stream
KEEPALIVE_SECONDS = 15.0  # an SSE comment (ndjson: nothing) after this long without an event
SSE_RETRY_MS = 1000
FORMATS = ("ndjson", "raw", "sse")
PROBES = 4096  # Read frames a lane keeps encoded, one per key_partition (then it starts over)
FRAME_OVERHEAD = 128  # bytes of a Message frame besides key, key_partition and payload (at most)
PUBLISH_TIMEOUT = 30.0  # seconds for a POST's messages to be processed
END_OF_TIME = (1 << 63) - 1  # a Read's start_time after every message: the vbucket's position only
# What one stream may hold for its HTTP client (at most --max-pending-bytes): the master's
# memory, which --memory-budget does not count, so smaller than a connection's bound.
STREAM_MAX_PENDING = 1 << 20


@dataclass
class GatewayCounters:
    """Plain integers, read at scrape time."""

    published: int = 0  # messages
    permission_denied: int = 0  # requests of a user outside its permissions (403)
    publish_requests: int = 0
    streams: int = 0  # open now
    streams_total: int = 0
    delivered: int = 0  # messages written to streams' buffers
    cut_slow: int = 0  # streams cut for their pending bytes
    losses_told: int = 0  # loss events written (ndjson, SSE)
    resumed: int = 0  # SSE streams resumed from their ledger
    resume_unknown: int = 0  # Last-Event-IDs the server could not use whole
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

    def add(self, vb: int, epoch: int, offset: int) -> None:
        events = self.events
        if len(events) >= LEDGER_EVENTS:
            old_vb, old_epoch, old_offset = events.popleft()
            self.base[old_vb] = (old_epoch, old_offset)
        events.append((vb, epoch, offset))

    def positions_at(self, vb: int, epoch: int, offset: int) -> dict[int, tuple[int, int]] | None:
        """Every vbucket's position as of the event at (vb, epoch, offset), or None: not kept."""
        for i, event in enumerate(self.events):
            if event == (vb, epoch, offset):
                at = dict(self.base)
                for e_vb, e_epoch, e_offset in itertools.islice(self.events, i + 1):
                    at[e_vb] = (e_epoch, e_offset)
                return at
        return None

    def restart(self, at: dict[int, tuple[int, int]]) -> None:
        self.base = at
        self.events.clear()


def encode_id(vb: int, epoch: int, offset: int, ledger: Ledger) -> str:
    return f"{b36(vb)}.{b36(epoch)}.{b36(offset)}.{b36(ledger.number)}.{ledger.secret}"


def decode_id(text: str) -> tuple[int, int, int, int, str] | None:
    """(vb, epoch, offset, stream number, secret) of an event id, or None: not one of ours."""
    parts = text.strip().split(".")
    if len(parts) != 5 or len(text) > 200:
        return None
    try:
        vb, epoch, offset, number = (int(p, 36) for p in parts[:4])
    except ValueError:
        return None
    if not 0 <= vb < 1024:
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
            "sse": "text/event-stream; charset=utf-8",
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
        self.user: str | None = None  # the user of its request (--users), and its pattern
        self.pattern = b""

    # ------------------------------------------------ from the SDK (inline, never blocks)

    def deliver(self, msg: Message) -> None:
        if self.ended:
            self.dropped += 1
            return
        fmt = self.format
        if fmt == "raw":
            data = msg.payload + b"\n"
        else:
            line = json.dumps(_as_json(msg), separators=(",", ":"))
            if fmt == "ndjson":
                data = line.encode() + b"\n"
            else:
                assert self.ledger is not None
                self.ledger.add(msg.vbucket, msg.epoch, msg.offset)
                event_id = encode_id(msg.vbucket, msg.epoch, msg.offset, self.ledger)
                data = f"id: {event_id}\ndata: {line}\n\n".encode()
        self.gateway.counters.delivered += 1
        self._put(data)
        if self.pending > self.max_pending:
            self.cut()

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

    def cut(self) -> None:
        """Past max_pending: drop what waits, say so, end."""
        self.gateway.counters.cut_slow += 1
        self.dropped += 1
        body = json.dumps(
            {"reason": "slow_consumer", "pending_bytes": self.pending, "limit": self.max_pending}
        )
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

    # ------------------------------------------------ to httpd (httpd.Stream)

    async def next(self) -> bytes | None:
        while not self.parts:
            if self.ended or self.closed:
                return None
            self.wake.clear()
            try:
                async with asyncio.timeout(KEEPALIVE_SECONDS):
                    await self.wake.wait()
            except TimeoutError:
                if self.format == "sse":
                    return b": keepalive\n\n"
        data = b"".join(self.parts)
        self.parts.clear()
        self.pending = 0
        return data

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ended = True
        self.wake.set()
        self._unsubscribe()
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
    out["vbucket"], out["epoch"], out["offset"] = msg.vbucket, str(msg.epoch), msg.offset
    out["ts_broker"] = msg.ts_broker
    if msg.uid is not None:
        out["uid"] = msg.uid_text
    return out


def _position(vb: int, epoch: int, offset: int) -> list[Any]:
    """A position in JSON: the epoch as a decimal string (it exceeds 2**53, JavaScript's exact
    integers)."""
    return [vb, str(epoch), offset]


def _text(data: bytes) -> str:
    return data.decode(errors="backslashreplace")


def _encode(key_partition: bytes, key: bytes, payload: bytes, ts_producer: int, uid: bytes) -> bytes:
    """A Message frame, as the SDK's compiled `encode` makes it (without the twin)."""
    return encode_message(key_partition, key, payload, ts_producer, uid=uid)


class Lane:
    """The gateway's publish connection to one worker (a connection.Handler): a POST's Read,
    its messages and a second Read go out in one write, and the two ReadDones say where the
    vbucket stood before and after (see the theory of operation). A worker handles one
    connection's frames in order, so ReadDones come in the order of the Reads: each takes
    the oldest waiter, and every Read can carry the same rid (its frame is cached)."""

    def __init__(self, encode: Callable[[bytes, bytes, bytes, int, bytes], bytes]) -> None:
        self.proto: WorkerProtocol | None = None
        self.encode = encode  # a Message frame (the SDK's compiled twin when it is built: same bytes)
        self.waiting: collections.deque[asyncio.Future[ReadDone]] = collections.deque()
        self.probes: dict[bytes, bytes] = {}  # key_partition -> its Read frame (bounded: PROBES)

    def on_message(self, msg: Message) -> None:  # a publish connection subscribes to nothing
        pass

    def on_frame(self, frame: Any) -> None:
        if isinstance(frame, ReadDone):
            if self.waiting:
                waiter = self.waiting.popleft()
                if not waiter.done():
                    waiter.set_result(frame)
        elif isinstance(frame, Error):  # NOT_MY_VBUCKET (a move), or worse: every POST under way fails
            self.fail(BrokyError(f"the worker refused: {frame.message or frame.code}"))

    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None:
        self.fail(BrokyError(f"the connection to the worker was lost{f': {exc}' if exc else ''}"))

    def fail(self, exc: BaseException) -> None:
        waiting, self.waiting = self.waiting, collections.deque()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_exception(exc)
        if self.proto is not None:
            self.proto.close()
            self.proto = None

    async def publish(
        self, partition: bytes, vb: int, key: bytes, payloads: list[bytes], timeout: float
    ) -> tuple[ReadDone, ReadDone]:
        """Publish; (the vbucket's ReadDone before, after).

        Raises:
            BrokyError: the connection was lost or the worker refused something.
        """
        proto = self.proto
        assert proto is not None
        probe = self.probes.get(partition)
        if probe is None:
            if len(self.probes) >= PROBES:
                self.probes.clear()
            probe = self.probes[partition] = encode_read(
                Read(1, b">", partition, start_time=END_OF_TIME, vbuckets=(vb,))
            )
        loop = asyncio.get_running_loop()
        before, after = loop.create_future(), loop.create_future()
        self.waiting.extend((before, after))
        now = time.time_ns()
        frames = [probe]
        encode = self.encode
        frames.extend(encode(partition, key, payload, now, new_ksuid()) for payload in payloads)
        frames.append(probe)
        proto.writelines(frames)
        try:
            async with asyncio.timeout(timeout):
                return await before, await after
        except TimeoutError:
            self.fail(BrokyError(f"the worker did not answer within {timeout:g} s"))
            raise BrokyError(f"the worker did not answer within {timeout:g} s") from None


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
        self.counters = GatewayCounters()
        self.streams: set[SubStream] = set()
        self.ledgers: collections.OrderedDict[int, Ledger] = collections.OrderedDict()
        self._numbers = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closing = False

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
        """The master's client of its own workers (connected once).

        Raises:
            HttpError: 503 while the workers are not ready, or the connection fails.
        """
        client = self.client
        if client is not None and not client.is_closed:
            return client
        if self.closing:
            raise HttpError(503, "the server is shutting down")
        if not self.ready():
            raise HttpError(503, "the workers are not ready yet; try again in a moment")
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
            stream.loss(dropped if reason != LossReason.UNACCOUNTED else None, name, "gateway")

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
        vb = vbucket_of(partition)
        try:
            first, done = await self._publish(client, partition, vb, key, payloads)
        except HttpError:
            raise
        except BrokyError as exc:
            raise HttpError(503, f"publish failed: {exc}") from None
        before = Position(vb, first.epoch, first.next - 1)
        after = Position(vb, done.epoch, done.next - 1)
        self.counters.publish_requests += 1
        self.counters.published += n
        exact = after.epoch == before.epoch and after.offset - before.offset == n
        answer: dict[str, Any] = {"published": n, "vbucket": vb, "exact": exact}
        if n and exact:
            answer["first"] = _position(vb, before.epoch, before.offset + 1)
            answer["last"] = _position(vb, after.epoch, after.offset)
        elif n:  # others published to the vbucket meanwhile (or its epoch changed): the bounds
            answer["first"] = answer["last"] = None
            answer["after"] = _position(vb, before.epoch, before.offset)
            answer["at_most"] = _position(vb, after.epoch, after.offset)
        return 200, "application/json", (json.dumps(answer) + "\n").encode()

    async def _publish(
        self, client: Client, partition: bytes, vb: int, key: bytes, payloads: list[bytes]
    ) -> tuple[ReadDone, ReadDone]:
        """Through the lane of the worker that owns `vb` (opened at its first use)."""
        info = client.server_info
        assert info is not None
        room = info.max_frame_bytes - FRAME_OVERHEAD - len(key) - len(partition)
        largest = max(map(len, payloads), default=0)
        if largest > room:
            raise HttpError(
                413,
                f"a message of {largest} bytes: at most {room} fit in a frame (--max-frame-bytes)",
            )
        node, worker = info.map.owners[vb]
        node_id = info.map.nodes[node].node_id
        lane = self.lanes.get((node_id, worker))
        if lane is None or lane.proto is None:
            from broky.client import pubpack  # the SDK: loaded at the first /v1/ request

            lane = self.lanes[(node_id, worker)] = Lane(
                _encode if pubpack.compiled is None else pubpack.compiled.encode
            )
            host, port = client.address_of(node_id)
            hello = Hello(worker=worker, client_name="http-gateway-pub", auth_token=self.config.auth_token)
            from broky.client.connection import open_connection

            try:
                lane.proto, _ = await open_connection(host, port, hello, 5.0, tls=client.tls)
            except (BrokyError, OSError) as exc:
                raise BrokyError(f"cannot reach worker {worker}: {exc}") from None
            lane.proto.attach(lane)
        return await lane.publish(partition, vb, key, payloads, PUBLISH_TIMEOUT)

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
        client = await self.sdk()
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
                on_loss=lambda dropped, reason: stream.loss(dropped, LossReason.name(reason), "stream"),
            )
        except BrokyError as exc:
            if ledger is not None:
                ledger.live = False
            raise HttpError(503, f"subscribe failed: {exc}") from None
        if ledger is not None:
            ledger.owner = stream
        self.streams.add(stream)
        self.counters.streams += 1
        self.counters.streams_total += 1
        return stream

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
        import hmac  # here, as in broky.server.httpd: only a resume needs it

        ledger = self.ledgers.get(number)
        at = None
        if ledger is not None and hmac.compare_digest(secret.encode(), ledger.secret.encode()):
            if ledger.owner is not None:  # its stream is still open (its client's going went unseen)
                ledger.owner.close()
            at = ledger.positions_at(vb, epoch, offset)
        else:
            ledger = None
        if at is None:  # resume its own vbucket; the rest from now, told
            self.counters.resume_unknown += 1
            return None, [Position(vb, epoch, offset)], True
        assert ledger is not None
        self.counters.resumed += 1
        self.ledgers.move_to_end(number)
        ledger.restart(at)
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
    raw = query.get(name)
    if raw is None:
        return 0
    if not raw.isascii() or not raw.isdigit() or len(raw) > 12:
        raise_bad(f"{name} must be a count (0 .. 999999999999), not {quote(raw)}")
    return int(raw)


def _time(raw: str | None) -> int | None:
    """?since_time=: seconds since the epoch (a number), or an ISO 8601 time with its zone; ns."""
    if raw is None:
        return None
    try:
        seconds = float(raw)
        if seconds == seconds and 0 <= seconds < 1e11:
            return int(seconds * 1e9)
    except ValueError:
        try:
            when = datetime.datetime.fromisoformat(raw)
        except ValueError:
            pass
        else:
            if when.tzinfo is not None:
                return int(when.timestamp() * 1e9)
    raise_bad(f"since_time must be seconds since the epoch or an ISO 8601 time with a zone, not {quote(raw)}")


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
