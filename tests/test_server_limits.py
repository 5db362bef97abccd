"""Per-connection limits on subscriptions (count and bytes) against a real
`broky serve`."""

from __future__ import annotations

import time
from typing import Any

from broky.errors import ErrorCode
from broky.protocol import Error
from tests.serverproc import ServerProcess
from tests.test_metrics import get_json, scrape, value
from tests.test_server_pubsub import debug_stats
from tests.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)


def worker0(server: ServerProcess) -> dict[str, Any]:
    return debug_stats(server)["workers"][0]  # type: ignore[no-any-return]


def limit_error(frames: list[Any], sid: int) -> Error:
    """The one frame, a non-fatal SUBSCRIPTION_LIMIT Error for `sid`."""
    assert len(frames) == 1, frames
    err = frames[0]
    assert isinstance(err, Error), err
    assert (err.code, err.fatal, err.sid) == (ErrorCode.SUBSCRIPTION_LIMIT, False, sid), err
    return err


def test_over_the_subscription_count_a_subscribe_is_refused_and_the_connection_stays(
    start_server: Any,
) -> None:
    server = start_server("--max-subscriptions", "3")
    with Wire.hello(server.address, worker=0) as w, Wire.hello(server.address, worker=0) as pub:
        for sid in (1, 2, 3):
            w.subscribe(sid, b"lim.%d" % sid)
        assert w.flush() == []
        w.subscribe(4, b"lim.4")
        message = limit_error(w.flush(), 4).message or ""
        assert "holds 3 subscriptions, max_subscriptions is 3" in message, message
        # Nothing was created for sid 4; the others still deliver.
        pub.publish(KP0, b"lim.4", b"no")
        pub.publish(KP0, b"lim.1", b"yes")
        assert pub.flush() == []
        assert [m.payload for m in w.messages()] == [b"yes"]
        # Room again after an Unsubscribe: the same sid is accepted.
        w.unsubscribe(1)
        w.subscribe(4, b"lim.4")
        assert w.flush() == []
        pub.publish(KP0, b"lim.4", b"now")
        assert pub.flush() == []
        assert [m.payload for m in w.messages()] == [b"now"]
        stats = worker0(server)
        assert stats["subscriptions"] == 3
        assert stats["errors"]["SUBSCRIPTION_LIMIT"] == 1
        assert stats["subscriptions_refused"] == {"count": 1, "bytes": 0}
        _, samples = scrape(server)
        assert value(samples, "broky_subscriptions_refused_total", worker="0", reason="count") == 1
        assert value(samples, "broky_subscriptions_refused_total", worker="0", reason="bytes") == 0
        assert value(samples, "broky_errors_sent_total", worker="0", code="subscription_limit") == 1
    warnings = [line for line in server.log().splitlines() if "SUBSCRIPTION_LIMIT" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings


def test_over_the_subscription_bytes_a_subscribe_is_refused(start_server: Any) -> None:
    server = start_server("--max-subscription-bytes", "1000")
    big = b"b." + b"x" * 400  # 402 bytes, 2 tokens: 402 + 2 * 64 = 530
    first = 530 + len(KP0)  # the key_partition counts too
    with Wire.hello(server.address, worker=0) as w, Wire.hello(server.address, worker=0) as pub:
        w.subscribe(1, big, key_partition=KP0)
        assert w.flush() == []
        w.subscribe(2, b"c." + b"y" * 400)
        message = limit_error(w.flush(), 2).message or ""
        assert f"holds {first} subscription bytes, this one is 530" in message, message
        assert "max_subscription_bytes is 1000" in message
        w.subscribe(3, b"small")  # 5 + 64 still fits
        assert w.flush() == []
        pub.publish(KP0, b"c." + b"y" * 400, b"refused")
        pub.publish(KP0, big, b"big")
        pub.publish(KP0, b"small", b"small")
        assert pub.flush() == []
        assert [m.payload for m in w.messages()] == [b"big", b"small"]
        stats = worker0(server)
        assert stats["subscription_bytes"] == first + 69
        assert stats["subscriptions_refused"] == {"count": 0, "bytes": 1}
        conn = next(c for c in get_json(server, "/connections")["connections"] if c["subscriptions"])
        assert conn["subscription_bytes"] == first + 69
        w.unsubscribe(1)  # frees its bytes: the refused one fits now
        w.subscribe(2, b"c." + b"y" * 400)
        assert w.flush() == []
        assert worker0(server)["subscription_bytes"] == 530 + 69
    deadline = time.monotonic() + 5
    while (stats := worker0(server))["connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["subscription_bytes"] == 0 and stats["subscriptions"] == 0
