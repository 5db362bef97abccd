"""`broky info`: what a server is and what it is doing, for a person or (--json) a program.

Theory of operation
-------------------
It connects as a client: the Welcome gives the node, its version, the
vbucket map (every node of a cluster) and the limits. The live part comes
from the node's metrics port (--metrics, else $BROKY_METRICS, else the
server's host on port 9477). A TLS server's HTTP port speaks https only, so
with a broky+tls:// server the default and a --metrics HOST:PORT without a
scheme are read over https (with the client's CAs); an http:// address that
closes without answering is reported with "use https://".

The summary (the default) reads /metrics twice, --interval seconds apart:
/metrics is open to anyone and labels every counter by worker
(`broky_connections{worker="0"} 3`), so the summary is the same with or
without the server's token. It prints one row per worker (up, vbuckets,
connections, subscriptions, groups, messages in and out per second, drops per
second, memory), in cluster mode the node's view of the cluster (its id,
the leader, members, map version, etcd), then the node's totals: messages published, delivered and
dropped with their rates, the drops by reason (the only way a message is
lost: each is counted with its reason), connections and subscriptions, and
the mean broker latency over the interval. Subscriptions, topics and groups
are the workers' own counts summed, and say so: a client's subscription to
every key_partition is one on each worker. A few lines, where the JSON has
some 150 counters.

--json prints everything as one JSON object: the Welcome's data, and /stats
(the server's own JSON of every counter; it needs the server's token when the
server has one, which `info` needed to connect anyway) read once. A program
computes its own rates.

Counters that cannot be read from an address given (--metrics or the
variable) are an error (exit 1, after what could be printed); from the
default guess they are one line saying how to point `info` at the metrics
port, and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import sys
import time
import urllib.request
from collections import defaultdict
from typing import Any

from broky.client.client import Client, ServerInfo
from broky.client.commands import DEFAULT_METRICS_PORT, ENV_METRICS
from broky.client.commands import client_options as _options
from broky.client.commands import fail as _fail
from broky.client.commands import run as _run
from broky.protocol.routing import VBucketMap, to_ranges

SAMPLE = re.compile(r"^(broky_\w+)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

MAX_RANGES = 8  # vbucket ranges shown per worker

Labels = tuple[tuple[str, str], ...]


class Metrics:
    """One reading of a /metrics page: value by name and labels, and when it was read."""

    def __init__(self, text: str, at: float) -> None:
        self.at = at
        self.values: dict[str, dict[Labels, float]] = defaultdict(dict)
        for line in text.splitlines():
            match = SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.groups()
            if name.endswith(("_bucket", "_created")):
                continue
            try:
                number = float(value)
            except ValueError:
                continue
            self.values[name][tuple(sorted(LABEL.findall(labels or "")))] = number

    def total(self, name: str) -> float:
        return sum(self.values.get(name, {}).values())

    def per(self, name: str, label: str) -> dict[str, float]:
        """`name` summed by the value of `label` (the worker, the reason)."""
        out: dict[str, float] = defaultdict(float)
        for labels, value in self.values.get(name, {}).items():
            out[dict(labels).get(label, "")] += value
        return out


def _base(address: str) -> str:
    return address if "://" in address else f"http://{address}"


def read_metrics(address: str, timeout: float = 2.0, context: Any = None) -> Metrics:
    """/metrics of `address` (host:port or a URL; https with the ssl.SSLContext `context`).

    Raises:
        OSError: it did not answer with the page.
    """
    with urllib.request.urlopen(f"{_base(address)}/metrics", timeout=timeout, context=context) as resp:
        return Metrics(resp.read().decode(errors="replace"), time.monotonic())


def read_stats(
    address: str, token: str | None, timeout: float = 2.0, context: Any = None, user: str | None = None
) -> dict[str, Any]:
    """/stats of `address` (with the token of a server that has one; with `user`, the
    token is USER:PASSWORD, sent as Basic credentials).

    Raises:
        OSError: it did not answer, or refused (urllib.error.HTTPError).
        ValueError: not JSON.
    """
    if user is not None:
        import base64

        headers = {"Authorization": "Basic " + base64.b64encode((token or "").encode()).decode()}
    else:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{_base(address)}/stats", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


# ---------------------------------------------------------------- rendering


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == 0 else f"{value:.1f}"


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.0f} {unit}"
    return f"{value:.0f} B"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def describe(info: ServerInfo, address: str) -> list[str]:
    """The Welcome's part: server, map, nodes and their workers' vbuckets, limits."""
    vmap = info.map
    lines = [
        f"server    {address}",
        f"version   {info.server_version or 'unknown'}",
        f"map       version {vmap.version}, {len(vmap.owners)} vbuckets, {len(vmap.nodes)} node(s)"
        + (", a move prepared" if vmap.incoming is not None else ""),
    ]
    for n, node in enumerate(vmap.nodes):
        lines.append(f"node      {node.node_id} at {node.host}:{node.port}, workers {node.workers}")
        for w in range(node.workers):
            vbs = vmap.vbuckets_of(n, w)
            spans = [f"{a}-{b}" if a != b else str(a) for a, b in to_ranges(vbs)]
            if len(spans) > MAX_RANGES:  # a cluster's map is fragmented: --json has them all
                spans[MAX_RANGES - 1 :] = [f"... ({len(spans)} ranges)"]
            lines.append(f"  worker {w}: {len(vbs)} vbuckets: {', '.join(spans)}")
    lines.append(
        f"limits    max_frame_bytes {info.max_frame_bytes}, max_pending_bytes {info.max_pending_bytes}"
    )
    return lines


def summary(before: Metrics, after: Metrics, source: str) -> list[str]:
    """The live part: a row per worker, then the node's totals, rates over the interval."""
    elapsed = max(after.at - before.at, 1e-9)

    def rate(name: str, worker: str | None = None) -> float:
        if worker is None:
            return (after.total(name) - before.total(name)) / elapsed
        return (
            after.per(name, "worker").get(worker, 0) - before.per(name, "worker").get(worker, 0)
        ) / elapsed

    per = {
        column: after.per(name, "worker")
        for column, name in (
            ("up", "broky_worker_up"),
            ("vbuckets", "broky_vbuckets_owned"),
            ("conns", "broky_connections"),
            ("subs", "broky_subscriptions"),
            ("groups", "broky_groups"),
            ("rss", "broky_worker_resident_memory_bytes"),
        )
    }
    workers = sorted(per["up"], key=lambda w: int(w) if w.isdigit() else -1)
    header = ("worker", "up", "vbuckets", "conns", "subs", "groups", "in/s", "out/s", "dropped/s", "memory")
    rows = [header]
    for w in workers:
        rows.append(
            (
                w,
                "yes" if per["up"].get(w) else "DOWN",
                _count(per["vbuckets"].get(w, 0)),
                _count(per["conns"].get(w, 0)),
                _count(per["subs"].get(w, 0)),
                _count(per["groups"].get(w, 0)),
                _rate(rate("broky_messages_published_total", w)),
                _rate(rate("broky_messages_delivered_total", w)),
                _rate(rate("broky_messages_dropped_total", w)),
                _bytes(per["rss"].get(w, 0)),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    up = sum(1 for w in workers if per["up"].get(w))
    lines = [
        f"live      from {source}: {up} of {len(workers)} workers up, rates over the last {elapsed:.1f} s"
    ]
    for row in rows:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:], strict=True)]
        lines.append("  " + "  ".join(cells).rstrip())

    for labels in after.values.get("broky_cluster_node_info", {}):  # cluster mode: one sample
        node = dict(labels)
        lines.append(
            f"cluster   node {node.get('node_id')}, leader {node.get('leader') or 'none'}, "
            f"{_count(after.total('broky_cluster_members'))} members, "
            f"map version {_count(after.total('broky_cluster_map_version'))}"
            + (" (a move prepared)" if after.total("broky_cluster_map_moving") else "")
            + ("" if after.total("broky_cluster_etcd_up") else ", etcd UNREACHABLE")
            + (", draining" if after.total("broky_cluster_draining") else "")
        )

    published, delivered = (
        after.total("broky_messages_published_total"),
        after.total("broky_messages_delivered_total"),
    )
    dropped = after.per("broky_messages_dropped_total", "reason")
    lines.append(
        f"messages  published {_count(published)} ({_rate(rate('broky_messages_published_total'))}/s), "
        f"delivered {_count(delivered)} ({_rate(rate('broky_messages_delivered_total'))}/s), "
        f"replayed {_count(after.total('broky_replayed_messages_total'))}"
    )
    reasons = ", ".join(
        f"{reason} {_count(n)}" for reason, n in sorted(dropped.items(), key=lambda r: -r[1]) if n
    )
    cut = after.total("broky_slow_consumer_disconnects_total")
    lines.append(
        f"dropped   {_count(sum(dropped.values()))} ({_rate(rate('broky_messages_dropped_total'))}/s)"
        + (f": {reasons}" if reasons else "")
        + (f"; {_count(cut)} slow consumer(s) disconnected" if cut else "")
    )
    refused = after.total("broky_connections_refused_total")
    lines.append(
        f"clients   {_count(sum(per['conns'].values()))} connections "
        f"({_count(after.total('broky_connections_opened_total'))} since start"
        + (f", {_count(refused)} refused at a limit" if refused else "")
        + f"); over the workers {_count(sum(per['subs'].values()))} subscriptions, "
        f"{_count(after.total('broky_topics'))} topics"
    )
    groups = sum(per["groups"].values())
    if groups or after.total("broky_group_delivered_total"):
        lines.append(
            f"groups    over the workers {_count(groups)} groups, "
            f"{_count(after.total('broky_group_members'))} members, "
            f"{_count(after.total('broky_in_flight'))} messages in flight; "
            f"acked {_count(after.total('broky_acks_total'))}, "
            f"redelivered {_count(after.total('broky_redelivered_total'))}, "
            f"dead-lettered {_count(after.total('broky_dead_lettered_total'))}"
        )
    count = after.total("broky_broker_latency_seconds_count") - before.total(
        "broky_broker_latency_seconds_count"
    )
    spent = after.total("broky_broker_latency_seconds_sum") - before.total("broky_broker_latency_seconds_sum")
    lines.append(
        f"latency   broker mean {_seconds(spent / count)} over {_count(count)} deliveries"
        if count > 0
        else "latency   no deliveries in the interval"
    )
    return lines


# ---------------------------------------------------------------- the command


def _metrics_address(args: argparse.Namespace, client: Client) -> tuple[str, bool]:
    """Where the counters are, and whether it was given (flag or variable) or guessed."""
    explicit = args.metrics or os.environ.get(ENV_METRICS)
    scheme = "https://" if client.tls is not None else ""  # a TLS server's HTTP port is https
    if explicit and "://" not in explicit:
        return scheme + explicit, True  # HOST:PORT of a TLS server: https, as its HTTP port speaks
    return explicit or f"{scheme}{client.address.host}:{DEFAULT_METRICS_PORT}", bool(explicit)


def _why(address: str, exc: OSError) -> object:
    """Why the counters could not be read from `address`: an http:// port that closed without
    answering may speak https (a Broky server with TLS serves its HTTP port over https only)."""
    reason = getattr(exc, "reason", exc)
    if isinstance(exc, http.client.RemoteDisconnected) and not address.startswith("https://"):
        host_port = address.split("://", 1)[-1]
        return f"{reason} (a Broky server with TLS serves its HTTP port over https only: use https://{host_port})"
    return reason


def _https(address: str, client: Client) -> Any:
    """The TLS client's SSLContext for an https address (its CAs check the HTTP port too)."""
    return client.tls if address.startswith("https://") else None


def _unavailable(address: str, reason: object) -> str:
    return (
        f"counters  unavailable from {address} (the default metrics port): {reason}; "
        f"pass --metrics HOST:PORT or set ${ENV_METRICS} (`broky serve` prints its metrics "
        "address in its ready line)"
    )


async def _welcome(args: argparse.Namespace, options: dict[str, Any]) -> tuple[ServerInfo, Client]:
    client = Client(args.server, **options)
    await client.connect()
    try:
        info = client.server_info
        assert info is not None
    finally:
        await client.close()
    return info, client


async def info_text(args: argparse.Namespace) -> int:
    options = _options(args, "broky-info")
    info, client = await _welcome(args, options)
    print("\n".join(describe(info, str(client.address))), flush=True)
    address, explicit = _metrics_address(args, client)
    try:
        before = await asyncio.to_thread(read_metrics, address, 2.0, _https(address, client))
        await asyncio.sleep(args.interval)
        after = await asyncio.to_thread(read_metrics, address, 2.0, _https(address, client))
    except OSError as exc:
        reason = _why(address, exc)
        if explicit:
            return _fail("info", f"no counters from {address}: {reason}")
        print(_unavailable(address, reason))
        return 0
    print("\n".join(summary(before, after, address)))
    return 0


def _map_json(vmap: VBucketMap) -> dict[str, Any]:
    return {
        "version": vmap.version,
        "moving": vmap.incoming is not None,
        "nodes": [
            {
                "node_id": node.node_id,
                "host": node.host,
                "port": node.port,
                "workers": [
                    {"worker": w, "vbuckets": [list(r) for r in to_ranges(vmap.vbuckets_of(n, w))]}
                    for w in range(node.workers)
                ],
            }
            for n, node in enumerate(vmap.nodes)
        ],
    }


async def info_json(args: argparse.Namespace) -> int:
    options = _options(args, "broky-info")
    info, client = await _welcome(args, options)
    out: dict[str, Any] = {
        "server": str(client.address),
        "node_id": info.node_id,
        "version": info.server_version,
        "limits": {"max_frame_bytes": info.max_frame_bytes, "max_pending_bytes": info.max_pending_bytes},
        "map": _map_json(info.map),
    }
    address, explicit = _metrics_address(args, client)
    out["metrics_address"] = address
    status = 0
    try:
        out["stats"] = await asyncio.to_thread(
            read_stats, address, client.auth_token, 2.0, _https(address, client), options.get("user")
        )
    except (OSError, ValueError) as exc:
        reason = _why(address, exc) if isinstance(exc, OSError) else exc
        out["stats"] = None
        out["error"] = f"no counters from {address}: {reason}"
        status = 1 if explicit else 0
    print(json.dumps(out, indent=1))
    if status:
        sys.stdout.flush()
        return _fail("info", out["error"])
    return 0


def main(args: argparse.Namespace) -> int:
    return _run(info_json(args) if args.json else info_text(args))
