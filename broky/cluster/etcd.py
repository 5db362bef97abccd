"""The one module that talks to etcd: a small, typed surface over aetcd.

Theory of operation
-------------------
aetcd (asyncio over grpcio) is imported here and nowhere else, and this
module is imported only in cluster mode (by the master's ClusterNode and by
`broky cluster status`), never by a worker: a single node never loads grpc.
The rest of Broky sees plain values (`KeyValue`, `Event`, lease ids as ints)
and one exception, `EtcdError`, for everything that can go wrong between
here and etcd: unreachable, timed out, stream broken, request refused.

Every unary call has a deadline (`timeout`), so a stopped etcd costs at most
that per call instead of hanging the caller. A watch has none: whoever
watches must notice a silent etcd some other way (the node's lease keepalive
does). One `Etcd` is one gRPC channel to one endpoint; after an error the
caller closes it and opens another (on the next endpoint), which is simpler
to reason about than a channel that reconnects underneath a watch.

Writes that must not race are transactions: `create` puts a key only if it
does not exist (a node id held by a live lease is not stolen), `put_if`
puts a key only if every guard holds (the leader's map writes: its own
member key still has the create_revision it registered with, and the map
still has the mod_revision the leader read). Both read the key back inside
the same transaction, so the caller learns the revisions it wrote without
waiting for the watch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

import aetcd

from broky.errors import BrokyError

PUT = "put"
DELETE = "delete"
CLOSE_TIMEOUT = 2.0  # closing a channel to a stopped etcd must not hang a shutdown


class EtcdError(BrokyError):
    """etcd could not be reached or did not answer in time (or refused the request)."""


class KeyValue(NamedTuple):
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


class Event(NamedTuple):
    kind: str  # PUT or DELETE
    kv: KeyValue  # for a DELETE: the key, no value, mod_revision = the deletion's revision


class Guard(NamedTuple):
    """A transaction condition: `target` ("create", "mod" or "version") of `key` == `value`."""

    target: str
    key: str
    value: int


def _kv(raw: Any) -> KeyValue:
    return KeyValue(
        raw.key.decode("utf-8", "replace"),
        bytes(raw.value),
        int(raw.create_revision),
        int(raw.mod_revision),
        int(raw.lease),
    )


def _error(exc: BaseException) -> EtcdError:
    text = str(exc).strip() or type(exc).__name__
    return EtcdError(text.splitlines()[0])


class Etcd:
    """One channel to one etcd endpoint (host, port); every call has a deadline of `timeout` s."""

    def __init__(self, endpoint: tuple[str, int], timeout: float) -> None:
        self.endpoint = endpoint
        self.client = aetcd.Client(host=endpoint[0], port=endpoint[1], timeout=timeout)

    def __str__(self) -> str:
        host, port = self.endpoint
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.client.close(), CLOSE_TIMEOUT)
        except (aetcd.ClientError, TimeoutError, OSError, RuntimeError):
            pass  # a channel we give up on: nothing more to say

    async def get(self, key: str) -> KeyValue | None:
        try:
            got = await self.client.get(key.encode())
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        return None if got is None else _kv(got)

    async def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """The revision of the store and every key under `prefix`."""
        try:
            got = await self.client.get_prefix(prefix.encode())
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        return int(got.header.revision), [_kv(kv) for kv in got]

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of `ttl` seconds: (its id, the TTL granted: etcd may raise it to its minimum)."""
        try:
            lease = await self.client.lease(ttl)
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        return int(lease.id), int(lease.ttl)

    async def keepalive(self, lease: int) -> int:
        """Refresh a lease; its TTL in seconds, <= 0 when it is gone (expired or revoked)."""
        try:
            reply = await self.client.refresh_lease(lease)
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        return -1 if reply is None else int(reply.TTL)

    async def lease_ttl(self, lease: int) -> tuple[int, int]:
        """(seconds left, seconds granted) of a lease; (-1, 0) when it is gone."""
        try:
            info = await self.client.get_lease_info(lease, keys=False)
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        return int(info.TTL), int(info.grantedTTL)

    async def revoke(self, lease: int) -> None:
        """Revoke a lease: every key attached to it is deleted."""
        try:
            await self.client.revoke_lease(lease)
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        try:
            await self.client.put(key.encode(), value, lease=lease)
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None

    async def delete(self, key: str) -> None:
        try:
            await self.client.delete(key.encode())
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None

    async def create(self, key: str, value: bytes, lease: int) -> tuple[bool, KeyValue | None]:
        """Put `key` only if it does not exist. Returns (created, the key as it now is)."""
        return await self._txn([Guard("version", key, 0)], key, value, lease)

    async def put_if(
        self, guards: Sequence[Guard], key: str, value: bytes, lease: int = 0
    ) -> tuple[bool, KeyValue | None]:
        """Put `key` only if every guard holds. Returns (written, the key as it now is)."""
        return await self._txn(guards, key, value, lease)

    async def _txn(
        self, guards: Sequence[Guard], key: str, value: bytes, lease: int
    ) -> tuple[bool, KeyValue | None]:
        tx = self.client.transactions
        targets = {"create": tx.create, "mod": tx.mod, "version": tx.version}
        compare = [targets[g.target](g.key.encode()) == g.value for g in guards]
        raw = key.encode()
        try:
            ok, responses = await self.client.transaction(
                compare=compare,
                success=[tx.put(raw, value, lease), tx.get(raw)],
                failure=[tx.get(raw)],
            )
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        ranges = [r for r in responses if isinstance(r, list)]
        found = ranges[0] if ranges else []
        return bool(ok), (_kv(found[0][1]) if found else None)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Event]:
        """Every change under `prefix` from `start_revision` on, in order, until an error.

        Raises:
            EtcdError: the watch could not start, or its stream broke.
        """
        try:
            watch = await self.client.watch_prefix(prefix.encode(), start_revision=start_revision)
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        try:
            async for event in watch:
                kind = PUT if event.kind == aetcd.EventKind.PUT else DELETE
                yield Event(kind, _kv(event.kv))
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise _error(exc) from None
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), CLOSE_TIMEOUT)
            except (aetcd.ClientError, TimeoutError, OSError, RuntimeError):
                pass
        raise EtcdError("the watch ended")
