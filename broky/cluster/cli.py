"""`broky cluster status`: members, leader, map and vbuckets, read from etcd directly.

Like `gazctl` for Gazette's brokers, it asks no Broky node anything: it reads
the keys the nodes keep in etcd (broky.cluster.layout), so it works while
nodes are down, and shows what the cluster agreed on rather than what one
node believes. `--json` prints the same as one JSON object. etcd unreachable
(every endpoint of --cluster tried in turn): one line on stderr, exit status
1; a bad address or no etcd client installed: exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from broky.cluster.layout import (
    ClusterURL,
    Keys,
    Member,
    MemberRecord,
    decode_ready,
    leader_of,
    parse_cluster_url,
)
from broky.protocol.routing import NO_OWNER, VBucketMap, to_ranges

ENV_CLUSTER = "BROKY_CLUSTER"
DEFAULT_TIMEOUT = 3.0


def _cluster(text: str) -> ClusterURL:
    try:
        return parse_cluster_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 3600:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def register(subparsers: Any) -> None:
    """Add `cluster` (and its `status`) to the `broky` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "cluster",
        help="look at a Broky cluster in etcd",
        description="Look at a Broky cluster: what its nodes keep in etcd.",
    )
    sub = parser.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)
    status = sub.add_parser(
        "status",
        help="members, leader, map version and vbuckets per node and worker",
        description=(
            "Print the members of the cluster (address, workers, state, lease), its leader, the "
            "version of its vbucket map (and whether a move is prepared) and the vbuckets of each "
            "node and worker, as etcd holds them."
        ),
    )
    status.add_argument(
        "--cluster",
        type=_cluster,
        default=None,
        help=f"etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (default ${ENV_CLUSTER})",
    )
    status.add_argument("--json", action="store_true", help="one JSON object instead of text")
    status.add_argument(
        "--timeout", type=_seconds, default=DEFAULT_TIMEOUT, help="seconds per etcd request (default 3)"
    )
    status.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    url: ClusterURL | None = args.cluster
    if url is None:
        raw = os.environ.get(ENV_CLUSTER)
        if not raw:
            return _fail(f"no cluster: pass --cluster etcd://HOST:PORT or set ${ENV_CLUSTER}", 2)
        try:
            url = parse_cluster_url(raw)
        except ValueError as exc:
            return _fail(f"${ENV_CLUSTER}: {exc}", 2)
    try:
        from broky.cluster.etcd import EtcdError
    except ImportError:
        return _fail("the etcd client is not installed: pip install 'broky[cluster]'", 2)
    try:
        import asyncio  # (not for `broky --help`)

        status = asyncio.run(read_status(url, args.timeout))
    except EtcdError as exc:
        return _fail(str(exc), 1)
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        print_status(status)
    return 0


def _fail(message: str, code: int) -> int:
    print(f"broky cluster status: {message}", file=sys.stderr)
    return code


async def read_status(url: ClusterURL, timeout: float) -> dict[str, Any]:
    """The cluster as etcd holds it (the shape `--json` prints).

    Raises:
        EtcdError: no endpoint answered.
    """
    from broky.cluster.etcd import Etcd, EtcdError

    failures: list[str] = []
    for endpoint in url.endpoints:
        etcd = Etcd(endpoint, timeout)
        try:
            return await _read(etcd, url, timeout)
        except EtcdError as exc:
            failures.append(f"{etcd}: {exc}")
        finally:
            await etcd.close()
    raise EtcdError(f"etcd unreachable ({'; '.join(failures)})")


async def _read(etcd: Any, url: ClusterURL, timeout: float) -> dict[str, Any]:
    keys = Keys(url.prefix)
    revision, kvs = await etcd.get_prefix(keys.prefix)
    members: dict[str, Member] = {}
    ready: dict[str, int] = {}
    vmap: VBucketMap | None = None
    problems: list[str] = []
    for kv in kvs:
        if kv.key.startswith(keys.members):
            try:
                members[kv.key[len(keys.members) :]] = Member(
                    MemberRecord.decode(kv.value), kv.create_revision, kv.lease
                )
            except ValueError as exc:
                problems.append(f"{kv.key}: {exc}")
        elif kv.key.startswith(keys.ready):
            ready[kv.key[len(keys.ready) :]] = decode_ready(kv.value)
        elif kv.key == keys.map:
            try:
                vmap = VBucketMap.from_json(json.loads(kv.value))
            except ValueError as exc:
                problems.append(f"{kv.key}: {exc}")
    leases = {m.node_id: (await etcd.lease_ttl(m.lease))[0] for m in members.values()}
    leader = leader_of(members.values())
    ids = sorted(set(members) | ({n.node_id for n in vmap.nodes} if vmap is not None else set()))
    nodes = [_node(node_id, members.get(node_id), vmap, ready, leases, leader) for node_id in ids]
    moving = 0 if vmap is None or vmap.incoming is None else sum(1 for i in vmap.incoming if i != NO_OWNER)
    return {
        "cluster": str(url),
        "endpoint": str(etcd),
        "revision": revision,
        "leader": leader,
        "members": len(members),
        "map": None
        if vmap is None
        else {
            "version": vmap.version,
            "moving": vmap.incoming is not None,
            "vbuckets_moving": moving,
            "nodes": [n.node_id for n in vmap.nodes],
        },
        "nodes": nodes,
        "problems": problems,
    }


def _node(
    node_id: str,
    member: Member | None,
    vmap: VBucketMap | None,
    ready: dict[str, int],
    leases: dict[str, int],
    leader: str | None,
) -> dict[str, Any]:
    index = vmap.node_index(node_id) if vmap is not None else None
    info = vmap.nodes[index] if vmap is not None and index is not None else None
    workers = member.record.workers if member is not None else info.workers if info is not None else 0
    if info is not None:
        workers = max(workers, info.workers)
    per_worker = []
    for w in range(workers):
        owned = vmap.vbuckets_of(index, w) if vmap is not None and index is not None else []
        coming: list[int] = []
        if vmap is not None and vmap.incoming is not None and index is not None:
            coming = [vb for vb, i in enumerate(vmap.incoming) if i == (index, w)]
        per_worker.append(
            {
                "worker": w,
                "vbuckets": len(owned),
                "ranges": [list(r) for r in to_ranges(owned)],
                "incoming": len(coming),
                "incoming_ranges": [list(r) for r in to_ranges(coming)],
            }
        )
    record = member.record if member is not None else None
    return {
        "node_id": node_id,
        "member": member is not None,
        "state": record.state if record is not None else "gone",
        "leader": node_id == leader,
        "host": record.host if record is not None else info.host if info is not None else None,
        "port": record.port if record is not None else info.port if info is not None else None,
        "workers": workers,
        "metrics_port": record.metrics_port if record is not None else None,
        "version": record.version if record is not None else None,
        "lease": f"{member.lease:x}" if member is not None else None,
        "lease_ttl_seconds": leases.get(node_id),
        "create_revision": member.create_revision if member is not None else None,
        "ready_version": ready.get(node_id),
        "map_version": record.map_version if record is not None else None,
        "in_map": index is not None,
        "vbuckets": sum(w["vbuckets"] for w in per_worker),
        "vbuckets_incoming": sum(w["incoming"] for w in per_worker),
        "worker_vbuckets": per_worker,
    }


def _ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)


def print_status(status: dict[str, Any]) -> None:
    vmap = status["map"]
    print(f"cluster   {status['cluster']} (etcd {status['endpoint']}, revision {status['revision']})")
    if vmap is None:
        print("map       none yet")
    elif vmap["moving"]:
        print(f"map       version {vmap['version']}, moving: {vmap['vbuckets_moving']} vbuckets prepared")
    else:
        print(f"map       version {vmap['version']}, stable, {len(vmap['nodes'])} node(s)")
    print(f"leader    {status['leader'] or 'none'}")
    print(f"members   {status['members']}")
    for problem in status["problems"]:
        print(f"problem   {problem}")
    rows = [("NODE", "ADDRESS", "STATE", "WORKERS", "LEASE", "VBUCKETS")]
    for n in status["nodes"]:
        address = f"{n['host']}:{n['port']}" if n["host"] is not None else "-"
        lease = f"{n['lease_ttl_seconds']} s left" if n["lease_ttl_seconds"] is not None else "-"
        state = n["state"] + (" (leader)" if n["leader"] else "")
        vbuckets = str(n["vbuckets"]) + (
            f" (+{n['vbuckets_incoming']} incoming)" if n["vbuckets_incoming"] else ""
        )
        rows.append((n["node_id"], address, state, str(n["workers"]), lease, vbuckets))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            continue
        node = status["nodes"][i - 1]
        for w in node["worker_vbuckets"]:
            line = f"  worker {w['worker']}: {w['vbuckets']} vbuckets: {_ranges(w['ranges']) or '-'}"
            if w["incoming"]:
                line += f"; incoming {w['incoming']}: {_ranges(w['incoming_ranges'])}"
            print(line)
