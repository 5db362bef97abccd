"""What the cluster keeps in etcd: the address of etcd, the keys and their values.

Theory of operation
-------------------
`--cluster etcd://HOST:PORT[,HOST:PORT...][/PREFIX]` names the etcd endpoints
(tried in turn; the port defaults to 2379) and the prefix under which one
cluster keeps its keys (default /broky, so that several clusters can share one
etcd). Under the prefix:

    <prefix>/members/<node_id>  leased by the node: a MemberRecord (JSON), the
                                node's address, workers, metrics port, version,
                                state ("serving", or "draining" once it was
                                asked to leave) and the version of the map it
                                runs (kept current: what a leader restores
                                from when etcd lost the map, see
                                broky.cluster.planner). The key's
                                create_revision orders the members: the
                                serving member with the lowest is the leader
                                (a draining one only while none serves).
    <prefix>/map                the vbucket map (VBucketMap.to_json); only the
                                leader writes it, and its version only grows.
    <prefix>/ready/<node_id>    leased by the node: {"version": v}, the last map
                                with vbuckets moving (`incoming`) that this node
                                and every subscriber of it has applied.
    <prefix>/handover/<node_id>/<worker>
                                leased by the node: the last handover record of
                                that worker (broky.server.shard.moves `Handed`, JSON):
                                the epoch and next offset of every vbucket it
                                stopped accepting when it applied map `version`,
                                for their new owners to continue the sequences.
                                One write per move and worker, none per message.

Everything here is pure: no etcd client is imported, so the single-node
server and `broky serve --help` never load grpc.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from broky.protocol.routing import NodeInfo

SCHEME = "etcd://"
DEFAULT_ETCD_PORT = 2379
DEFAULT_PREFIX = "/broky"
SERVING = "serving"
DRAINING = "draining"
STATES = (SERVING, DRAINING)


class ClusterURL(NamedTuple):
    endpoints: tuple[tuple[str, int], ...]  # etcd (host, port), tried in turn
    prefix: str  # no trailing slash, e.g. "/broky"

    def __str__(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"{SCHEME}{hosts}{self.prefix}"


def parse_cluster_url(text: str) -> ClusterURL:
    """Parse `etcd://HOST:PORT[,HOST:PORT...][/PREFIX]` (IPv6 hosts in brackets).

    Raises:
        ValueError: the text is not such an address (the message says why).
    """
    raw = text.strip()
    if not raw.lower().startswith(SCHEME):
        raise ValueError(f"a cluster address starts with {SCHEME}, not {text!r}")
    rest = raw[len(SCHEME) :]
    hosts, slash, path = rest.partition("/")
    prefix = ("/" + path).rstrip("/") if slash else DEFAULT_PREFIX
    if not prefix:
        raise ValueError(f"empty prefix in {text!r}: leave it out for {DEFAULT_PREFIX}")
    if any(c in prefix for c in "?#@ ") or "//" in prefix:
        raise ValueError(f"bad prefix {prefix!r} in {text!r}")
    endpoints = tuple(_endpoint(part, text) for part in hosts.split(","))
    return ClusterURL(endpoints, prefix)


def _endpoint(part: str, text: str) -> tuple[str, int]:
    if not part:
        raise ValueError(f"no etcd host in {text!r}")
    if part.startswith("["):
        end = part.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in {text!r}")
        host, after = part[1:end], part[end + 1 :]
        if after and not after.startswith(":"):
            raise ValueError(f"unexpected {after!r} after [{host}] in {text!r}")
        port_text = after[1:]
    elif part.count(":") > 1:
        raise ValueError(f"write IPv6 addresses in brackets ([::1]:2379) in {text!r}")
    else:
        host, _, port_text = part.partition(":")
    if not host or "@" in host:
        raise ValueError(f"bad etcd host {part!r} in {text!r}")
    if not port_text:
        return host, DEFAULT_ETCD_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad etcd port {port_text!r} in {text!r}")
    return host, int(port_text)


class Keys:
    """The key names of one cluster (see the module's header)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix + "/"
        self.members = prefix + "/members/"
        self.ready = prefix + "/ready/"
        self.map = prefix + "/map"
        self.handover = prefix + "/handover/"

    def member(self, node_id: str) -> str:
        return self.members + node_id

    def ready_of(self, node_id: str) -> str:
        return self.ready + node_id

    def handover_of(self, node_id: str, worker: int) -> str:
        return f"{self.handover}{node_id}/{worker}"


class MemberRecord(NamedTuple):
    """The value of <prefix>/members/<node_id>."""

    node_id: str
    host: str  # what clients dial (--advertise-host)
    port: int
    workers: int
    metrics_port: int
    version: str  # broky's
    state: str = SERVING
    map_version: int = 0  # the version of the map the node runs (0: none yet)

    @property
    def info(self) -> NodeInfo:
        """The node as a vbucket map names it."""
        return NodeInfo(self.node_id, self.host, self.port, self.workers)

    def encode(self) -> bytes:
        return json.dumps(self._asdict(), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> MemberRecord:
        """Raises ValueError for a value that is not a member record."""
        try:
            raw: dict[str, Any] = json.loads(data)
            record = cls(
                str(raw["node_id"]),
                str(raw["host"]),
                int(raw["port"]),
                int(raw["workers"]),
                int(raw.get("metrics_port", 0)),
                str(raw.get("version", "")),
                str(raw.get("state", SERVING)),
                int(raw.get("map_version", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a member record: {exc!r}") from None
        if record.workers < 1 or record.state not in STATES or record.map_version < 0:
            raise ValueError(f"not a member record: {raw!r}")
        return record


class Member(NamedTuple):
    """A live member as etcd shows it: its record and its key's revisions."""

    record: MemberRecord
    create_revision: int  # orders the members: the lowest is the leader
    lease: int

    @property
    def node_id(self) -> str:
        return self.record.node_id

    @property
    def serving(self) -> bool:
        return self.record.state == SERVING


def leader_of(members: Any) -> str | None:
    """The node id of the serving member with the lowest create_revision; while none
    serves, of the draining member with the lowest (None: no member). A draining
    leader so hands the leadership over as soon as its record says it drains: the
    member that stays plans its departure like any other's (broky.cluster.node)."""
    best: Member | None = None
    for m in members:
        if best is None or (m.serving, -m.create_revision) > (best.serving, -best.create_revision):
            best = m
    return None if best is None else best.node_id


def encode_ready(version: int) -> bytes:
    return json.dumps({"version": version}).encode()


def decode_ready(data: bytes) -> int:
    """The map version of a ready value (0 for one that does not read)."""
    try:
        return int(json.loads(data)["version"])
    except (ValueError, KeyError, TypeError):
        return 0
