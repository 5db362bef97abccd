"""Routing: key_partition -> vbucket -> (node, worker), and the vbucket map.

vbucket = xxh3_64(key_partition, seed 0) mod 1024. A VBucketMap says which
node and which worker on it owns each vbucket; its version grows whenever
the map changes. While vbuckets move between workers, `incoming` names the
owner each one is moving to (schema/README.md section 6.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import xxhash

VBUCKETS = 1024
NO_OWNER = (0xFFFF, 0xFFFF)  # in VBucketMap.incoming: this vbucket is not moving
_xxh3 = xxhash.xxh3_64_intdigest


def vbucket_of(key_partition: bytes) -> int:
    """Return the vbucket (0..1023) of a key_partition."""
    return _xxh3(key_partition) & (VBUCKETS - 1)


class NodeInfo(NamedTuple):
    """One node of the cluster, as the Welcome frame describes it."""

    node_id: str
    host: str
    port: int
    workers: int


class VBucketMap(NamedTuple):
    """Owner (node index, worker) of each of the 1024 vbuckets; `incoming`, while
    vbuckets move, the owner each moves to (NO_OWNER for one that does not)."""

    version: int
    nodes: tuple[NodeInfo, ...]
    owners: tuple[tuple[int, int], ...]
    incoming: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def single_node(cls, node: NodeInfo, version: int = 1) -> VBucketMap:
        """The map of one node whose workers own contiguous, equal vbucket ranges."""
        if node.workers < 1:
            raise ValueError("a node needs at least one worker")
        owners = tuple((0, vb * node.workers // VBUCKETS) for vb in range(VBUCKETS))
        return cls(version, (node,), owners)

    def owner(self, key_partition: bytes) -> tuple[int, int]:
        """Return (node index, worker) owning key_partition."""
        return self.owners[vbucket_of(key_partition)]

    def vbuckets_of(self, node: int, worker: int) -> list[int]:
        """Return the vbuckets owned by one worker of one node."""
        return [vb for vb, own in enumerate(self.owners) if own == (node, worker)]

    def ranges_of(self, node: int, worker: int) -> list[tuple[int, int]]:
        """Return the inclusive vbucket ranges owned by one worker, for display."""
        return to_ranges(self.vbuckets_of(node, worker))

    def node_index(self, node_id: str) -> int | None:
        """The index of node `node_id` in `nodes`, or None."""
        for i, node in enumerate(self.nodes):
            if node.node_id == node_id:
                return i
        return None

    def to_json(self) -> dict[str, Any]:
        """The map as JSON data (how the cluster keeps it in etcd and sends it to workers)."""
        return {
            "version": self.version,
            "nodes": [list(n) for n in self.nodes],
            "owners": [list(o) for o in self.owners],
            "incoming": None if self.incoming is None else [list(o) for o in self.incoming],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VBucketMap:
        """The map of `to_json` data.

        Raises:
            ValueError: the data is not a valid map (wrong size, an owner naming no node).
        """
        try:
            nodes = tuple(NodeInfo(str(n[0]), str(n[1]), int(n[2]), int(n[3])) for n in data["nodes"])
            owners = tuple((int(o[0]), int(o[1])) for o in data["owners"])
            raw = data.get("incoming")
            incoming = None if raw is None else tuple((int(o[0]), int(o[1])) for o in raw)
            vmap = cls(int(data["version"]), nodes, owners, incoming)
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"not a vbucket map: {exc!r}") from None
        vmap.check()
        return vmap

    def check(self) -> None:
        """Raises ValueError unless the map is well formed."""
        if len(self.owners) != VBUCKETS:
            raise ValueError(f"a map has {VBUCKETS} owners, not {len(self.owners)}")
        if self.incoming is not None and len(self.incoming) != VBUCKETS:
            raise ValueError(f"incoming has {VBUCKETS} entries, not {len(self.incoming)}")
        n = len(self.nodes)
        for node, worker in self.owners:
            if node >= n or worker >= self.nodes[node].workers:
                raise ValueError(f"owner ({node}, {worker}) names no worker of the map's {n} nodes")
        for node, worker in self.incoming or ():
            if (node, worker) != NO_OWNER and (node >= n or worker >= self.nodes[node].workers):
                raise ValueError(f"incoming owner ({node}, {worker}) names no worker of the map's {n} nodes")


def to_ranges(vbuckets: Sequence[int]) -> list[tuple[int, int]]:
    """Collapse sorted vbuckets into inclusive (first, last) ranges."""
    out: list[tuple[int, int]] = []
    for vb in vbuckets:
        if out and out[-1][1] == vb - 1:
            out[-1] = (out[-1][0], vb)
        else:
            out.append((vb, vb))
    return out
