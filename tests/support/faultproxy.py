"""A fault-injecting TCP proxy for reconnect tests.

`FaultProxy(target).start()` listens on a free loopback port and forwards
every accepted connection to `target`, in a daemon thread with its own event
loop (so it serves asyncio tests and blocking-client tests alike). Faults:

- `cut()`: abort every connection now, both sides (a network cut or a reset);
- `refuse(True)`: new connections are reset as soon as they are accepted,
  until `refuse(False)` (a server that is down: the client sees the
  connection fail at once, not a handshake timeout);
- `stall(True)`: stop forwarding in both directions (bytes are held, not lost)
  until `stall(False)`.

`stop()` closes the listener and every connection and joins the thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class _Pipe(asyncio.Protocol):
    def __init__(self, proxy: FaultProxy, accepted: bool = False) -> None:
        self.proxy = proxy
        self.accepted = accepted  # the client's side (else the upstream side)
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.held: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.accepted:
            # decided here, once the transport exists (the factory runs before it does)
            if self.proxy.refusing:
                self.proxy.refused += 1
                transport.abort()
            else:
                self.proxy._loop.create_task(self.proxy._connect_upstream(self))

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None or self.proxy.stalled:
            self.held.append(data)
        else:
            self.peer.transport.write(data)

    def release(self) -> None:
        if self.held and self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(b"".join(self.held))
            self.held.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.proxy._pipes.discard(self)
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class FaultProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.accepted = 0
        self.refused = 0
        self.refusing = False
        self.stalled = False
        self._pipes: set[_Pipe] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def start(self) -> FaultProxy:
        self._thread.start()

        async def listen() -> None:
            self._server = await self._loop.create_server(self._client_pipe, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._call(listen)
        return self

    def _client_pipe(self) -> _Pipe:
        pipe = _Pipe(self, accepted=True)
        self.accepted += 1
        self._pipes.add(pipe)
        return pipe

    async def _connect_upstream(self, client: _Pipe) -> None:
        try:
            _, upstream = await self._loop.create_connection(lambda: _Pipe(self), *self.target)
        except OSError:
            client.abort()
            return
        if client.transport is None or client.transport.is_closing():
            upstream.abort()
            return
        self._pipes.add(upstream)
        client.peer, upstream.peer = upstream, client
        client.release()

    def cut(self) -> None:
        """Abort every connection, both sides."""

        def cut_all() -> None:
            for pipe in list(self._pipes):
                pipe.abort()

        self._call(cut_all)

    def refuse(self, on: bool) -> None:
        """While on, close new connections at once (and cut the live ones when turned on)."""
        self.refusing = on
        if on:
            self.cut()

    def stall(self, on: bool) -> None:
        """While on, hold every byte in both directions."""

        def set_stall() -> None:
            self.stalled = on
            if not on:
                for pipe in list(self._pipes):
                    pipe.release()

        self._call(set_stall)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for pipe in list(self._pipes):
                pipe.abort()
            await asyncio.sleep(0.01)

        self._call(shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
