"""Reconnects that name their previous connection (Hello.previous), and the
restart grace of a worker that replaced a dead one (raw frames, real server).

What is checked is exactness: the Welcome says how many of the previous
connection's publishes were processed, and a LossNotice says how many of the
deliveries queued to it never arrived, counted against what really arrived.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broky.protocol import (
    Goodbye,
    LossNotice,
    LossReason,
    Message,
    Pause,
    Ping,
    Pong,
    PreviousConnection,
    Resumed,
    encode_message,
)
from tests.support.http import http_get
from tests.support.serverproc import ServerProcess, kill_worker
from tests.support.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)


class Clients:
    """Raw connections to one server, all closed at the end of the test."""

    def __init__(self) -> None:
        self.server: ServerProcess | None = None
        self.opened: list[Wire] = []

    def hello(self, **kwargs: Any) -> Wire:
        assert self.server is not None
        w = Wire.hello(self.server.address, **kwargs)
        self.opened.append(w)
        return w


@pytest.fixture
def clients() -> Iterator[Clients]:
    c = Clients()
    yield c
    for w in c.opened:
        w.close()


def previous(w: Wire, received: int = 0, told_lost: int = 0) -> PreviousConnection:
    """What the client of `w` names in its next Hello, with the proof its Welcome gave it."""
    assert w.welcome is not None
    return PreviousConnection(w.welcome.connection_id, received, told_lost, w.welcome.resume_token)


def read_messages(w: Wire, n: int) -> list[Message]:
    return [w.expect(Message) for _ in range(n)]


def test_a_reconnect_to_a_live_worker_learns_what_was_processed_and_what_was_lost(
    start_server: Any, clients: Clients
) -> None:
    server = clients.server = start_server()
    watcher = clients.hello(worker=0)  # sees every publish the worker processed
    watcher.subscribe(1, b"p.>")
    assert watcher.flush() == []
    # A subscriber that reads little: 3,000 deliveries of 1 KiB back up in TCP and
    # in the worker (8 MiB bound: none dropped), then it goes away, having read 40.
    slow = clients.hello(worker=0, rcvbuf=16384)
    slow.subscribe(1, b"s.>")
    assert slow.flush() == []
    pub = clients.hello(worker=0)
    pub.send(*(encode_message(KP0, b"s.x", b"%04d" % i + bytes(1020)) for i in range(3000)))
    assert pub.flush() == []
    got = read_messages(slow, 40)
    assert [m.payload[:4] for m in got] == [b"%04d" % i for i in range(40)]
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    slow.close()  # a reset: nothing more arrives
    # The publisher loses its connection with publishes in flight: some were processed.
    pub.send(*(encode_message(KP0, b"p.x", b"%d" % i) for i in range(200)))
    pub.close()
    time.sleep(0.3)

    again = clients.hello(worker=0, previous=previous(slow, received=40))
    assert again.welcome is not None and again.welcome.resumed == Resumed(previous(slow).connection_id, 0)
    assert again.flush() == [LossNotice(3000 - 40, LossReason.CONNECTION_LOST)]

    pub2 = clients.hello(worker=0, previous=previous(pub))
    assert pub2.welcome is not None and pub2.welcome.resumed is not None
    processed = pub2.welcome.resumed.processed
    seen = watcher.messages()
    assert processed == 3000 + len(seen)  # exactly the ones a subscriber got
    assert [m.payload for m in seen] == [b"%d" % i for i in range(len(seen))]
    # An account is answered once.
    third = clients.hello(worker=0, previous=previous(pub))
    assert third.welcome is not None and third.welcome.resumed is None
    _, body = http_get(server, "/metrics")
    text = body.decode()
    assert 'broky_messages_dropped_total{reason="connection_lost",worker="0"} 2960.0' in text
    assert 'broky_resumes_total{result="connection_lost",worker="0"} 2.0' in text
    assert 'broky_resumes_total{result="unknown",worker="0"} 1.0' in text


def test_a_killed_workers_accounts_answer_its_clients_through_its_successor(
    start_server: Any, clients: Clients
) -> None:
    server = clients.server = start_server()
    paused = clients.hello(worker=0)  # its deliveries stay in the worker
    paused.subscribe(1, b"k.>")
    paused.send(Pause())
    assert paused.flush() == []
    reader = clients.hello(worker=0)
    reader.subscribe(1, b"k.>")
    assert reader.flush() == []
    pub = clients.hello(worker=0)
    pub.send(*(encode_message(KP0, b"k.x", b"%d" % i) for i in range(7)))
    assert pub.flush() == []
    assert len(reader.messages()) == 7
    kill_worker(server, 0)

    # Every subscribing connection of the dead worker comes back (the grace ends).
    paused2 = clients.hello(worker=0, previous=previous(paused))
    assert paused2.welcome is not None and paused2.welcome.resumed == Resumed(
        previous(paused).connection_id, 0
    )
    reader2 = clients.hello(worker=0, previous=previous(reader, received=7))
    pub2 = clients.hello(worker=0, previous=previous(pub))
    assert pub2.welcome is not None and pub2.welcome.resumed == Resumed(previous(pub).connection_id, 7)
    assert paused2.flush() == [LossNotice(7, LossReason.WORKER_RESTART)]
    assert reader2.flush() == []
    assert pub2.flush() == []
    _, body = http_get(server, "/metrics")
    text = body.decode()
    assert 'broky_messages_dropped_total{reason="worker_restart",worker="0"} 7.0' in text
    assert 'broky_resumes_total{result="worker_restart",worker="0"} 3.0' in text
    assert "left the accounts of 3 connections (2 subscribing were open)" in server.log()


def test_publishes_wait_for_the_dead_workers_subscribers(start_server: Any, clients: Clients) -> None:
    server = clients.server = start_server()
    sub = clients.hello(worker=0)
    sub.subscribe(1, b"g.>")
    assert sub.flush() == []
    other = clients.hello(worker=0)  # a subscriber that does not come back
    other.subscribe(1, b"nothing.>")
    assert other.flush() == []
    kill_worker(server, 0)

    pub = clients.hello(worker=0)
    pub.send(*(encode_message(KP0, b"g.x", b"%d" % i) for i in range(5)), Ping(99))
    pub.expect_silence(0.3)  # held: its Pong waits behind its publishes
    sub2 = clients.hello(worker=0, previous=previous(sub))
    sub2.subscribe(1, b"g.>")
    sub2.expect_silence(0.2)  # still held: `other` is not back
    other2 = clients.hello(worker=0, previous=previous(other))
    other2.subscribe(1, b"nothing.>")
    assert other2.flush() == []  # its Ping ends the grace: the publishes are routed
    assert [m.payload for m in sub2.messages()] == [b"%d" % i for i in range(5)]
    assert pub.expect(Pong).id == 99
    _, body = http_get(server, "/metrics")
    assert 'broky_messages_dropped_total{reason="no_subscribers",worker="0"} 0.0' in body.decode()
    assert "2 of 2 subscribing connections back" in server.log()


def test_the_grace_ends_in_time_when_a_subscriber_stays_away(start_server: Any, clients: Clients) -> None:
    server = clients.server = start_server("--restart-grace", "0.5")
    sub = clients.hello(worker=0)
    sub.subscribe(1, b"g.>")
    assert sub.flush() == []
    kill_worker(server, 0)
    pub = clients.hello(worker=0)
    started = time.monotonic()
    pub.send(*(encode_message(KP0, b"g.x", b"%d" % i) for i in range(3)))
    assert pub.flush(timeout=5) == []
    assert 0.3 < time.monotonic() - started < 3.0
    _, body = http_get(server, "/metrics")
    text = body.decode()
    assert 'broky_messages_dropped_total{reason="no_subscribers",worker="0"} 3.0' in text
    assert 'broky_restart_subscribers_missing{worker="0"} 1.0' in text
    assert "0 of 1 subscribing connections back" in server.log()


def test_goodbye_says_how_many_publishes_were_processed(start_server: Any, clients: Clients) -> None:
    server = clients.server = start_server()
    pub = clients.hello(worker=0)
    pub.send(*(encode_message(KP0, b"x.y", b"%d" % i) for i in range(12)))
    assert pub.flush() == []
    server.signal(signal.SIGTERM)
    assert server.wait(5.0) == 0
    assert pub.expect_closed() == [Goodbye("server shutting down", 12)]
