"""A whole server restarted under its clients loses nothing silently (issue 26, finding 1).

Before: `broky serve` SIGKILLed and started again within 2 s under load lost
about 2,000 messages and told nobody. The publisher's SDK sent its reconnect
buffer into the new process before the subscriber had subscribed again, and
the server counted those messages only as no_subscribers. A worker restart had
a grace (the master keeps the dead worker's accounts); a server restart had none.

Now the first client that names a connection of an earlier server process
makes every worker hold publishes for --restart-grace seconds (the server
restart grace), and a subscriber whose connection nobody can account for is
told so (LossNotice UNACCOUNTED): what was published after the restart is
delivered, and what was in flight in the dead process is either sent again by
its publisher (with its uid: copies are dropped) or covered by that notice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from bench import chaos
from broky.protocol import (
    RESUME_TOKEN_BYTES,
    LossNotice,
    LossReason,
    Ping,
    Pong,
    PreviousConnection,
    encode_message,
)
from tests.support.http import http_get
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)


def of_another_process() -> PreviousConnection:
    """What a client names after the server it was connected to died: an id of an
    epoch this server never gave out (and a secret it cannot check)."""
    return PreviousConnection(int.from_bytes(os.urandom(8), "little"), 10, 0, os.urandom(RESUME_TOKEN_BYTES))


def metric(server: ServerProcess, line_start: str) -> float:
    _, body = http_get(server, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    raise AssertionError(f"no {line_start} in /metrics")


def test_publishes_wait_for_the_old_processs_subscribers(
    start_server: Callable[..., ServerProcess], opened: list[Wire]
) -> None:
    server = start_server("--restart-grace", "1.5")
    # The publisher comes back first, naming its connection to the dead process.
    pub = Wire.hello(server.address, worker=0, previous=of_another_process())
    opened.append(pub)
    assert pub.next() == LossNotice(0, LossReason.UNACCOUNTED)
    started = time.monotonic()
    pub.send(*(encode_message(KP0, b"r.x", b"%d" % i) for i in range(5)), Ping(7))
    pub.expect_silence(0.3)  # held: its Pong waits behind its publishes
    # The subscriber comes back within the grace and subscribes again.
    sub = Wire.hello(server.address, worker=0, previous=of_another_process())
    opened.append(sub)
    sub.subscribe(1, b"r.>")
    assert sub.flush() == [LossNotice(0, LossReason.UNACCOUNTED)]  # told: it may have lost some
    assert pub.expect(Pong, timeout=5).id == 7
    assert time.monotonic() - started > 1.0  # the grace, not the subscriber, released them
    assert [m.payload for m in sub.messages(timeout=5)] == [b"%d" % i for i in range(5)]
    assert metric(server, 'broky_messages_dropped_total{reason="no_subscribers",worker="0"}') == 0
    assert metric(server, 'broky_server_restart_graces_total{worker="0"}') == 1
    assert metric(server, 'broky_server_restart_graces_total{worker="1"}') == 1
    assert "this server restarted" in server.log()
    # Once per process: a later such claim holds nothing.
    late = Wire.hello(server.address, worker=0, previous=of_another_process())
    opened.append(late)
    late.publish(KP0, b"r.x", b"late")
    assert late.flush(timeout=1.0) == [LossNotice(0, LossReason.UNACCOUNTED)]
    assert [m.payload for m in sub.messages(timeout=5)] == [b"late"]
    assert metric(server, 'broky_server_restart_graces_total{worker="0"}') == 1


@pytest.mark.timeout(120)
def test_a_server_killed_and_started_again_under_sdk_load_loses_nothing_silently() -> None:
    """SDK publisher (sequence numbers per key_partition) and subscriber; the server
    SIGKILLed twice and started again on its port 1.5 s later (bench.chaos)."""
    out = chaos.server_restart(restarts=2, interval=6.0, down=1.5, rate=2000, partitions=200)
    summary = "\n".join(out.lines())
    assert out.published > 15_000, summary
    # Everything published while the server was down, or after, arrives: held for the
    # subscribers of the old process, or sent again by the publisher.
    assert out.lost_not_in_flight == 0, summary
    # What was in flight in the killed process is either sent again or told.
    assert out.untold <= 0, summary
    assert out.unaccounted_notices >= 2, summary  # each restart told the subscriber (2 workers)
    assert out.duplicates == 0 and out.out_of_order == 0, summary
    assert out.publisher_flush_error is None, summary
    assert all(f["recovery_s"] is not None for f in out.faults), summary
