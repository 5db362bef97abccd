"""`publish(key, payload, partition=...)`: the key first, the partition a keyword defaulting
to the key (as `broky pub KEY PAYLOAD` does); the old `publish(key_partition, key, payload)`
warns and still publishes where it did; a key or partition `broky pub` refuses is refused by
the SDK too, naming the argument (issue 41)."""

from __future__ import annotations

from typing import Any

import pytest

import broky
from tests.support.sdk import run, take
from tests.support.serverproc import ServerProcess

BAD_KEYS = [
    ("", "must not be empty"),
    ("orders.*", "has a wildcard token"),
    ("orders.>", "has a wildcard token"),
    ("*", "has a wildcard token"),
    ("orders..created", "has an empty token"),
    (".orders", "has an empty token"),
    ("orders.", "has an empty token"),
]


def fields(messages: list[Any]) -> list[tuple[bytes, bytes, bytes]]:
    return [(m.key_partition, m.key, m.payload) for m in messages]


def test_publish_takes_the_key_then_the_payload_the_partition_defaulting_to_the_key(
    server: ServerProcess,
) -> None:
    async def main() -> None:
        async with broky.connect(server.url, name="t") as client:
            sub = await client.subscribe("orders.>")
            for _ in range(3):  # the third time, from the fast path's cache (compiled or not)
                await client.publish("orders.created", b"a")
            await client.publish("orders.created", b"b", partition="customer-42")
            await client.publish(b"orders.paid", b"c", partition=b"customer-42")
            client.publish_nowait("orders.nowait", b"d")
            client.publish_nowait("orders.nowait", b"e", partition="t1")
            assert await client.publish_many(["orders.m1", "orders.m2"], [b"f", b"g"]) == 2
            await client.publish_many(["orders.m1"], [b"h"], partitions=["t2"])
            await client.flush()
            got = fields(await take(sub, 10))
            assert sorted(got) == sorted(
                [(b"orders.created", b"orders.created", b"a")] * 3
                + [
                    (b"customer-42", b"orders.created", b"b"),
                    (b"customer-42", b"orders.paid", b"c"),
                    (b"orders.nowait", b"orders.nowait", b"d"),
                    (b"t1", b"orders.nowait", b"e"),
                    (b"orders.m1", b"orders.m1", b"f"),
                    (b"orders.m2", b"orders.m2", b"g"),
                    (b"t2", b"orders.m1", b"h"),
                ]
            )

    run(main)


def test_the_old_three_argument_form_warns_at_the_call_and_publishes_where_it_did(
    server: ServerProcess,
) -> None:
    async def main() -> None:
        async with broky.connect(server.url, name="t") as client:
            sub = await client.subscribe("old.>")
            with pytest.warns(DeprecationWarning, match=r"publish\(key, payload, partition=\.\.\.\)") as told:
                for _ in range(3):  # the compiled fast path's cache too
                    await client.publish("kp-1", b"old.a", b"1")
            assert {w.filename for w in told} == {__file__}  # the caller's line, not the SDK's
            with pytest.warns(DeprecationWarning, match="publish_nowait"):
                client.publish_nowait("kp-2", b"old.b", b"2")
            with pytest.warns(DeprecationWarning, match=r"publish_many\(keys, payloads, partitions=\.\.\.\)"):
                await client.publish_many(["kp-3"], [b"old.c"], [b"3"])
            with pytest.raises(TypeError, match="takes 2 positional arguments"):
                await client.publish("kp", "old.d", b"4", partition="kp")  # type: ignore[arg-type]
            await client.flush()
            got = fields(await take(sub, 5))
            assert sorted(got) == [(b"kp-1", b"old.a", b"1")] * 3 + [
                (b"kp-2", b"old.b", b"2"),
                (b"kp-3", b"old.c", b"3"),
            ]

    run(main)


@pytest.mark.parametrize(("key", "problem"), BAD_KEYS)
def test_a_key_broky_pub_refuses_is_refused_naming_the_argument(
    server: ServerProcess, key: str, problem: str
) -> None:
    async def main() -> None:
        async with broky.connect(server.url, name="t") as client:
            sub = await client.subscribe(">")
            for _ in range(3):  # a good shape cached on the fast path first
                await client.publish("ok.key", b"x")
            for publish in (
                lambda: client.publish(key, b"x"),
                lambda: client.publish(key, b"x", partition="p"),
                lambda: client.publish(key, b"x", uid=False),  # the general path, always
                lambda: client.publish_many(["ok.key", key], [b"x", b"x"]),
            ):
                with pytest.raises(broky.BadKeyError) as raised:
                    await publish()
                assert raised.value.argument == "key"
                assert str(raised.value).startswith(f"publish(key={key!r}): {problem}")
                assert isinstance(raised.value, ValueError)
            with pytest.raises(broky.BadKeyError):
                client.publish_nowait(key.encode(), b"x")
            # publish_many published the row before the refused one, and nothing else went
            await client.flush()
            got = fields(await take(sub, 4))
            assert got == [(b"ok.key", b"ok.key", b"x")] * 4
            assert client.stats.published == 4
            await client.publish("ok.*b", b"a star inside a token is a byte")  # not a wildcard token
            await client.flush()
            assert [m.key for m in await take(sub, 1)] == [b"ok.*b"]

    run(main)


def test_an_empty_partition_is_refused_naming_it(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url, name="t") as client:
            for partition in ("", b""):
                with pytest.raises(broky.BadKeyError) as raised:
                    await client.publish("orders.created", b"x", partition=partition)
                assert raised.value.argument == "partition"
                assert str(raised.value).startswith("publish(partition=''): must not be empty")
            with pytest.raises(broky.BadKeyError, match=r"publish\(partition=''\)"):
                await client.publish_many(["a.b"], [b"x"], partitions=[""])
            # a partition is opaque otherwise: dots and stars are bytes like others
            await client.publish("orders.created", b"x", partition="tenant.*")
            await client.flush()
            assert client.stats.published == 1

    run(main)


def test_the_blocking_client_takes_the_same_arguments(server: ServerProcess) -> None:
    with broky.connect_sync(server.url, name="t") as client:
        sub = client.subscribe("sync.>")
        client.publish("sync.a", b"1")
        client.publish("sync.a", b"2", partition="t1")
        with pytest.warns(DeprecationWarning, match=r"publish\(key, payload, partition=\.\.\.\)") as told:
            client.publish("t2", b"sync.b", b"3")
        assert {w.filename for w in told} == {__file__}
        with pytest.warns(DeprecationWarning, match="publish_many"):
            client.publish_many(["t3"], [b"sync.c"], [b"4"])
        assert client.publish_many(["sync.d"], [b"5"], partitions=["t4"]) == 1
        for key, problem in BAD_KEYS:
            with pytest.raises(broky.BadKeyError, match=problem) as raised:
                client.publish(key, b"x")
            assert raised.value.argument == "key"
            assert str(raised.value).startswith(f"publish(key={key!r}): ")
        with pytest.raises(broky.BadKeyError, match=r"publish\(partition=''\)"):
            client.publish("sync.e", b"x", partition="")
        client.flush()
        got = [(m.key_partition, m.key, m.payload) for m in (sub.next(timeout=10) for _ in range(5))]
        assert sorted(got) == [
            (b"sync.a", b"sync.a", b"1"),
            (b"t1", b"sync.a", b"2"),
            (b"t2", b"sync.b", b"3"),
            (b"t3", b"sync.c", b"4"),
            (b"t4", b"sync.d", b"5"),
        ]
        assert client.stats.published == 5
