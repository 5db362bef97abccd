"""A resume is a capability: only the client a connection was made for can claim its
account (issue 26, finding 2). Raw frames against a real server.

The hijack that was possible: a connection id is public (its worker's epoch is in
any client's own Welcome, and /connections lists ids), and Hello.previous with a
guessed id used to supersede the live victim, or take a closed connection's
account (its `resumed` answer and its LossNotices). Now every claim must carry the
connection's secret, Welcome.resume_token.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from broky.protocol import (
    RESUME_TOKEN_BYTES,
    LossNotice,
    LossReason,
    PreviousConnection,
    Resumed,
    encode_message,
)
from tests.support.http import http_get
from tests.support.serverproc import ServerProcess, kill_worker
from tests.support.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)


def hello(server: ServerProcess, opened: list[Wire], **kwargs: Any) -> Wire:
    w = Wire.hello(server.address, **kwargs)
    opened.append(w)
    return w


def claim(w: Wire, token: bytes | None, received: int = 0) -> PreviousConnection:
    assert w.welcome is not None
    return PreviousConnection(w.welcome.connection_id, received, 0, token)


def forged(w: Wire) -> bytes:
    """A token of the right size that is not the connection's."""
    assert w.welcome is not None and w.welcome.resume_token is not None
    return bytes(b ^ 0xFF for b in w.welcome.resume_token)


def resumes(server: ServerProcess, result: str, worker: int = 0) -> float:
    _, body = http_get(server, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(f'broky_resumes_total{{result="{result}",worker="{worker}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no broky_resumes_total for {result}/{worker}")


def test_every_connection_gets_its_own_secret(server: ServerProcess, opened: list[Wire]) -> None:
    tokens = {hello(server, opened, worker=0).welcome.resume_token for _ in range(20)}  # type: ignore[union-attr]
    assert len(tokens) == 20
    assert all(t is not None and len(t) == RESUME_TOKEN_BYTES for t in tokens)


def test_a_live_connection_is_not_superseded_by_a_claim_without_its_secret(
    server: ServerProcess, opened: list[Wire]
) -> None:
    victim = hello(server, opened, worker=0)
    victim.subscribe(1, b"v.>")
    assert victim.flush() == []
    for token in (None, forged(victim), b"short"):
        thief = hello(server, opened, worker=0, previous=claim(victim, token))
        assert thief.welcome is not None and thief.welcome.resumed is None
        # told like any client whose previous connection nobody can account for
        assert thief.flush() == [LossNotice(0, LossReason.UNACCOUNTED)]
    pub = hello(server, opened, worker=0)
    pub.publish(KP0, b"v.x", b"still here")
    assert pub.flush() == []
    assert [m.payload for m in victim.messages()] == [b"still here"]  # never disconnected
    assert resumes(server, "refused") == 3
    assert "without its resume token: refused" in server.log()


def test_a_closed_connections_account_stays_for_its_owner(server: ServerProcess, opened: list[Wire]) -> None:
    owner = hello(server, opened, worker=0)
    owner.subscribe(1, b"o.>")
    assert owner.flush() == []
    pub = hello(server, opened, worker=0)
    pub.send(*(encode_message(KP0, b"o.x", b"%d" % i) for i in range(5)))
    assert pub.flush() == []
    owner.close()  # it received none of the 5 deliveries it was sent (it read nothing)
    thief = hello(server, opened, worker=0, previous=claim(owner, forged(owner)))
    assert thief.welcome is not None and thief.welcome.resumed is None
    assert thief.flush() == [LossNotice(0, LossReason.UNACCOUNTED)]  # not the owner's notice
    back = hello(server, opened, worker=0, previous=claim(owner, owner.welcome.resume_token))  # type: ignore[union-attr]
    assert back.welcome is not None
    assert back.welcome.resumed == Resumed(owner.welcome.connection_id, 0)  # type: ignore[union-attr]
    assert back.flush() == [LossNotice(5, LossReason.CONNECTION_LOST)]  # exact, and to its owner
    assert resumes(server, "refused") == 1
    _, body = http_get(server, "/metrics")
    assert 'broky_messages_dropped_total{reason="connection_lost",worker="0"} 5.0' in body.decode()


def test_a_dead_workers_account_needs_the_secret_too(server: ServerProcess, opened: list[Wire]) -> None:
    owner = hello(server, opened, worker=0)
    owner.subscribe(1, b"d.>")
    assert owner.flush() == []
    pub = hello(server, opened, worker=0)
    pub.send(*(encode_message(KP0, b"d.x", b"%d" % i) for i in range(3)))
    assert pub.flush() == []
    kill_worker(server, 0)
    thief = hello(server, opened, worker=0, previous=claim(owner, forged(owner)))
    assert thief.welcome is not None and thief.welcome.resumed is None
    assert thief.flush() == [LossNotice(0, LossReason.UNACCOUNTED)]
    back = hello(server, opened, worker=0, previous=claim(owner, owner.welcome.resume_token))  # type: ignore[union-attr]
    assert back.welcome is not None and back.welcome.resumed is not None
    back.subscribe(1, b"d.>")  # its subscriptions first: the restarted worker waits for them
    assert back.flush() == [LossNotice(3, LossReason.WORKER_RESTART)]


def test_no_endpoint_and_no_log_line_shows_a_secret(server: ServerProcess, opened: list[Wire]) -> None:
    wires = [hello(server, opened, worker=w % 2) for w in range(4)]
    secrets = [w.welcome.resume_token for w in wires]  # type: ignore[union-attr]
    wires[0].subscribe(1, b"s.>")
    assert wires[0].flush() == []
    hello(server, opened, worker=0, previous=claim(wires[1], forged(wires[1])))  # a refused claim is logged
    bodies = [http_get(server, path)[1] for path in ("/connections", "/stats", "/topics", "/metrics")]
    seen = b"\n".join([*bodies, server.log().encode()])
    for secret in secrets:
        assert secret is not None
        for form in (secret, secret.hex().encode(), base64.b64encode(secret), repr(secret).encode()):
            assert form not in seen
    listed = json.loads(bodies[0])["connections"]
    assert {c["id"] for c in listed} >= {w.welcome.connection_id for w in wires}  # type: ignore[union-attr]


def test_a_forged_claim_for_an_unknown_worker_epoch_changes_nothing(
    server: ServerProcess, opened: list[Wire]
) -> None:
    sub = hello(server, opened, worker=0)
    sub.subscribe(1, b"u.>")
    assert sub.flush() == []
    bogus = PreviousConnection(int.from_bytes(os.urandom(8), "little"), 0, 0, os.urandom(RESUME_TOKEN_BYTES))
    other = hello(server, opened, worker=0, previous=bogus)
    assert other.flush() == [LossNotice(0, LossReason.UNACCOUNTED)]
    # Within its first minute a server takes such a claim for a sign that it restarted
    # under its clients (tests/server/e2e/test_server_restart.py): publishes wait --restart-grace
    # for the old process's subscribers, then flow, and the live subscriber gets them.
    pub = hello(server, opened, worker=0)
    pub.publish(KP0, b"u.x", b"after")
    assert pub.flush(timeout=10) == []
    assert [m.payload for m in sub.messages(timeout=5)] == [b"after"]
