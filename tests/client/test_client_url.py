"""Server address parsing and the client's checks that need no server."""

from __future__ import annotations

import asyncio
import socket

import pytest

import broky
from broky.client.url import DEFAULT_PORT, ServerAddress, parse_server


@pytest.fixture
def unused_port() -> int:
    """A loopback TCP port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("broky://127.0.0.1:4800", ("127.0.0.1", 4800)),
        ("127.0.0.1:4800", ("127.0.0.1", 4800)),
        ("localhost", ("localhost", DEFAULT_PORT)),
        ("broky://example.org", ("example.org", DEFAULT_PORT)),
        ("BROKY://h:1/", ("h", 1)),
        ("[::1]:4801", ("::1", 4801)),
        ("[::1]", ("::1", DEFAULT_PORT)),
        ("  h:2  ", ("h", 2)),
    ],
)
def test_parse_server_forms(text: str, expected: tuple[str, int]) -> None:
    assert parse_server(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("nats://h:1", "scheme"),
        ("h:", "empty port"),
        ("h:x", "not a number"),
        ("h:70000", "out of range"),
        ("h:0", "out of range"),
        ("", "no host"),
        ("broky://", "no host"),
        (":4777", "no host"),
        ("::1", "brackets"),
        ("h:1/path", "no path"),
        ("[::1", "unclosed"),
    ],
)
def test_parse_server_rejects(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_server(text)


def test_default_server_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BROKY_SERVER", raising=False)
    assert parse_server(None) == ("127.0.0.1", DEFAULT_PORT)
    monkeypatch.setenv("BROKY_SERVER", "broky://10.1.2.3:5000")
    assert parse_server(None) == ("10.1.2.3", 5000)


def test_address_text_round_trips() -> None:
    for addr in (ServerAddress("h", 1), ServerAddress("::1", 4777)):
        assert parse_server(str(addr)) == addr


def test_exports() -> None:
    for name in ("connect", "connect_sync", "Client", "SyncClient", "Message", "Subscription", "__version__"):
        assert hasattr(broky, name), name
    assert broky.Message is broky.protocol.Message
    for name in dir(broky.errors):
        obj = getattr(broky.errors, name)
        if isinstance(obj, type) and issubclass(obj, broky.BrokyError):
            assert getattr(broky, name) is obj, name


def test_bad_options_are_rejected_before_connecting() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        broky.Client("h:1", batch_size=0)
    with pytest.raises(ValueError, match="scheme"):
        broky.Client("http://h:1")


def test_nothing_listening_is_a_connection_error_after_the_timeout(unused_port: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(broky.BrokyConnectionError, match="cannot connect") as info:
            await broky.connect(f"127.0.0.1:{unused_port}", connect_timeout=0.5)
        assert isinstance(info.value, ConnectionError)
        assert 0.45 <= loop.time() - start < 3

    asyncio.run(main())
    with pytest.raises(broky.BrokyConnectionError):
        broky.connect_sync(f"127.0.0.1:{unused_port}", connect_timeout=0.3)


def test_using_an_unconnected_or_closed_client_is_a_clear_error() -> None:
    async def main() -> None:
        client = broky.Client("127.0.0.1:1")
        with pytest.raises(broky.BrokyConnectionError, match="not connected"):
            await client.publish(b"k", b"v", partition=b"p")
        await client.close()
        with pytest.raises(broky.ClientClosedError):
            await client.publish(b"k", b"v", partition=b"p")
        with pytest.raises(broky.ClientClosedError):
            await client.subscribe("k")
        with pytest.raises(broky.ClientClosedError):
            await client.flush()

    asyncio.run(main())
