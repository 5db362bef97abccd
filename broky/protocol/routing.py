"""Routing: key_partition -> vbucket -> (node, worker), and the vbucket map.

vbucket = xxh3_64(key_partition, seed 0) mod 1024. A VBucketMap says which
node and which worker on it owns each vbucket; its version grows whenever
ownership changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import xxhash

VBUCKETS = 1024
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
    """Owner (node index, worker) of each of the 1024 vbuckets."""

    version: int
    nodes: tuple[NodeInfo, ...]
    owners: tuple[tuple[int, int], ...]

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


def to_ranges(vbuckets: Sequence[int]) -> list[tuple[int, int]]:
    """Collapse sorted vbuckets into inclusive (first, last) ranges."""
    out: list[tuple[int, int]] = []
    for vb in vbuckets:
        if out and out[-1][1] == vb - 1:
            out[-1] = (out[-1][0], vb)
        else:
            out.append((vb, vb))
    return out
