"""A burst, SDK to SDK, with default settings: Broky's SDK against nats.py and redis-py.

    python -m bench.sdk_burst [--messages 300000] [--runs 3] [--workers 2]
                              [--systems broky,nats,redis] [--partitions 256] [--size 100]
                              [--burst 0] [--pause 0.01] [--name sdk_burst]

The scenario a new user tries: one asyncio publisher process publishes
`--messages` messages of `--size` bytes over `--partitions` key_partitions
as fast as it can, then flushes; one asyncio subscriber process reads them
with a wildcard subscription and `async for`. Every setting is the default,
on every side: the servers' pending bounds, the clients' queues.

- Broky: `await client.publish(b"cpu.k", payload, partition=partition)` one by one, the
  subscriber on `cpu.>`.
- NATS (nats.py): `await nc.publish(subject, payload)` one by one, where the
  subject carries the partition as NATS users do (`cpu.k` for one,
  `cpu.k.tenant-N` for many); the subscriber on `cpu.>`.
- Redis (redis-py's asyncio client with hiredis, the maintained asyncio
  client): PUBLISH to the channel named as for NATS, pipelined 1,000 per round
  trip (one round trip per message would measure the network, not Redis); the
  subscriber on PSUBSCRIBE `cpu.*`.
- Broky with other server settings, as systems of their own that alternate
  with the others (VARIANTS): `broky_noreplay` is `broky serve --replay-bytes 0`
  (no replay buffer; `broky` runs the defaults, the buffer on); `broky_users` is
  `broky serve --users FILE` with clients that connect as a user who may publish
  under `cpu.>` only (every publish goes through that user's route cache).

`--burst N` makes the publisher pause `--pause` seconds after every N
messages (bursts with quiet moments between them, rather than one burst).
`--warm N` first publishes N of the same messages with nobody subscribed:
Broky's replay buffer keeps them, so the measured burst meets a full buffer
(a server that has run a while) rather than an empty one (a fresh server,
whose buffer's first fill touches new memory: a page fault per 4 KiB).
Broky's runs report the replay buffers' bytes, segments, messages and
evictions before and after the burst (/stats).

Reported per system (runs alternate): messages received of those published,
what the subscriber was told it lost, the publisher's time, the time until
the subscriber had the last message, deliveries per second over that time,
the server's CPU per delivered message over the burst (every process of it, to
the nanosecond from the scheduler: bench.harness.procstat), and the server's
peak RSS; the spread of every run, and each run's ratio to the other systems
in the same round; how busy the rest of the machine was during each run (the
CPU of the processes that are not the run's: other users of a shared machine).
MATRIX lists the SDK-to-SDK headline rows of `python -m bench`. Results:
bench/results/sdk_burst.md and .json (`--name`), with the machine.

`one_run(..., check=True)` (tests/bench/test_sdk_burst.py; Broky only) also puts
the key_partition's index and a sequence number per key_partition in the
first 8 bytes of every payload, and the subscriber checks every message it
takes: its key, key_partition and padding, and each key_partition's
sequence (copies, reordering, gaps). Benchmark runs leave it off: the checks
cost the subscriber CPU the peers' subscribers do not spend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import options, procstat, roles, servers  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import SDK_TITLES, heading, table, write_results  # noqa: E402

SYSTEMS = ("broky", "nats", "redis")
# Broky with other server options: system name -> (the clients' system, `broky serve` options).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "broky_noreplay": ("broky", ["--replay-bytes", "0"]),
    "broky_users": ("broky", []),  # --users: the clients are a user limited to publish cpu.> (_start)
}
ENV_AUTH = "BENCH_BROKY_AUTH"  # a client process's Hello.auth_token (broky_users)
USERS_AUTH = "bench:bench"
# Systems whose connections are TLS (bench/tls.py): system -> the clients' system. Their
# servers get a certificate (servers.tls_files), their client processes `--tls-ca`.
TLS_SYSTEMS = {"broky_tls": "broky", "nats_tls": "nats"}
TITLES = {
    **SDK_TITLES,
    "broky_noreplay": "Broky SDK, replay off",
    "broky_users": "Broky SDK, a user with limited permissions",
    "broky_tls": "Broky SDK, TLS",
    "nats_tls": "nats.py, TLS",
}
_tls_ca: str | None = None  # in a client process: connect with TLS, trusting this CA
QUIET = 3.0  # seconds without a message after which the subscriber stops counting
# ... in TLS runs: nats.py's TLS subscriber was seen silent for over 3 s mid-burst on a
# busy 2-core machine (and then counted 299,999 of 300,000 lost); its server CPU over the
# extra idle seconds is a few ms.
TLS_QUIET = 15.0
REDIS_PIPELINE = 1000
_head = struct.Struct("<II")  # check mode: key_partition index, sequence number in it


def clients_of(system: str) -> str:
    """Which clients a system's runs use (a variant of Broky: Broky's SDK)."""
    if system in TLS_SYSTEMS:
        return TLS_SYSTEMS[system]
    return VARIANTS[system][0] if system in VARIANTS else system


def _users_file() -> str:
    """A users file whose one user may publish under cpu.> only (not cpu.secret.>)."""
    import tempfile

    from broky.server.security.users import hash_password

    f = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)  # noqa: SIM115
    user, password = USERS_AUTH.split(":")
    f.write(
        f'[users.{user}]\npassword = "{hash_password(password, 1000)}"\n'
        'publish = { allow = ["cpu.>"], deny = ["cpu.secret.>"] }\n'
    )
    f.close()
    return f.name


def _broky_connect(address: str, **settings: Any) -> Any:
    """broky.connect, with TLS in a TLS run's client process."""
    import broky

    if os.environ.get(ENV_AUTH):  # a users run: the clients connect as the limited user
        settings["auth_token"] = os.environ[ENV_AUTH]
    if _tls_ca is None:
        return broky.connect(address, **settings)
    import ssl

    ctx = ssl.create_default_context(cafile=_tls_ca)
    return broky.connect(f"broky+tls://{address}", ssl_context=ctx, **settings)


async def _nats_connect(address: str, **settings: Any) -> Any:
    """nats.connect, with TLS in a TLS run's client process."""
    import nats

    if _tls_ca is None:
        return await nats.connect(f"nats://{address}", **settings)
    import ssl

    return await nats.connect(f"tls://{address}", tls=ssl.create_default_context(cafile=_tls_ca), **settings)


def partitions(system: str, count: int) -> list[Any]:
    """What each system's publisher names the partitions by (precomputed on every side)."""
    if system == "broky":
        return [b"tenant-%d" % i for i in range(count)]
    return ["cpu.k"] if count == 1 else [f"cpu.k.tenant-{i}" for i in range(count)]


# ------------------------------------------------------------ subscribers


async def _broky_sub(
    address: str, expected: int, parts: int = 0, size: int = 0, check: bool = False
) -> dict[str, Any]:

    told: list[int] = []
    checked: dict[str, Any] = {}
    async with _broky_connect(address, on_loss=lambda ref, n, reason: told.append(n)) as client:
        sub = await client.subscribe("cpu.>")
        roles.ready()
        it = _checked(sub.__aiter__(), parts, size, checked) if check else sub.__aiter__()
        got, last, error = await _count(it, expected)
        return {"received": got, "told_lost": sum(told), "dropped_local": client.stats.dropped_local,
                "pauses": client.stats.pauses, "duplicates_dropped": client.stats.duplicates_dropped,
                "last_at": last, "error": error, **checked}  # fmt: skip


async def _checked(it: Any, parts: int, size: int, out: dict[str, Any]) -> Any:
    """Check mode: every message of `it`, checked (see the header), then passed on; the
    counts in `out` (per key_partition: the messages taken)."""
    names = partitions("broky", parts)
    pad = b"x" * (size - _head.size)
    nxt = [0] * parts  # the sequence number expected next, per key_partition
    out.update(corrupt=0, duplicates=0, out_of_order=0, gaps=0, per_partition=[0] * parts)
    async for msg in it:
        i, seq = _head.unpack_from(msg.payload)
        if i >= parts or msg.key != b"cpu.k" or msg.key_partition != names[i] or msg.payload[8:] != pad:
            out["corrupt"] += 1
        else:
            out["per_partition"][i] += 1
            if seq < nxt[i]:
                out["duplicates" if seq == nxt[i] - 1 else "out_of_order"] += 1
            else:
                out["gaps"] += seq - nxt[i]
                nxt[i] = seq + 1
        yield msg


async def _nats_sub(address: str, expected: int) -> dict[str, Any]:

    errors: list[str] = []

    async def on_error(exc: Exception) -> None:  # nats.py reports its slow-consumer drops here
        errors.append(type(exc).__name__)

    nc = await _nats_connect(address, error_cb=on_error)
    sub = await nc.subscribe("cpu.>")
    await nc.flush()
    roles.ready()
    got, last, error = await _count(sub.messages.__aiter__(), expected)
    await nc.close()
    return {"received": got, "errors_reported": len(errors), "last_at": last, "error": error}


async def _redis_sub(address: str, expected: int) -> dict[str, Any]:
    import redis.asyncio as redis

    host, port = address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port))
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.psubscribe("cpu.*")
    roles.ready()

    async def messages() -> Any:
        async for m in pubsub.listen():
            if m is not None and m["type"] == "pmessage":
                yield m

    got, last, error = await _count(messages().__aiter__(), expected)
    try:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()
    except Exception:  # the server cut the connection (its output buffer limit): counted as error
        pass
    return {"received": got, "last_at": last, "error": error}


async def _count(it: Any, expected: int) -> tuple[int, float, str | None]:
    """Messages taken from `it` until `expected`, QUIET seconds of silence or an error."""
    got, last = 0, time.time()
    while got < expected:
        try:
            await asyncio.wait_for(it.__anext__(), QUIET if got else 60)
        except (TimeoutError, StopAsyncIteration):
            break
        except Exception as exc:  # the connection was closed under the subscriber
            return got, last, f"{type(exc).__name__}: {exc}"[:200]
        got += 1
        last = time.time()
    return got, last, None


# ------------------------------------------------------------ publishers


def _bursts(n: int, burst: int) -> list[range]:
    """The message numbers of each burst: all of them at once unless `burst`."""
    step = burst or n or 1
    return [range(first, min(first + step, n)) for first in range(0, n, step)]


async def _broky_pub(
    address: str, n: int, parts: int, size: int, burst: int = 0, pause: float = 0.0, check: bool = False
) -> dict[str, Any]:

    names = partitions("broky", parts)
    payload = b"x" * size
    pad = payload[_head.size :]
    async with _broky_connect(address) as client:
        started = time.time()
        for k, numbers in enumerate(_bursts(n, burst)):
            if k:
                await asyncio.sleep(pause)
            if check:  # round robin: message i is number i // parts of key_partition i % parts
                for i in numbers:
                    await client.publish(
                        b"cpu.k", _head.pack(i % parts, i // parts) + pad, partition=names[i % parts]
                    )
            else:
                for i in numbers:
                    await client.publish(b"cpu.k", payload, partition=names[i % parts])
        await client.flush()
        return {"published": n, "started_at": started, "seconds": time.time() - started}


async def _nats_pub(
    address: str, n: int, parts: int, size: int, burst: int = 0, pause: float = 0.0
) -> dict[str, Any]:

    names = partitions("nats", parts)
    payload = b"x" * size
    nc = await _nats_connect(address)
    started = time.time()
    for k, numbers in enumerate(_bursts(n, burst)):
        if k:
            await asyncio.sleep(pause)
        for i in numbers:
            await nc.publish(names[i % parts], payload)
    await nc.flush()
    seconds = time.time() - started
    await nc.close()
    return {"published": n, "started_at": started, "seconds": seconds}


async def _redis_pub(
    address: str, n: int, parts: int, size: int, burst: int = 0, pause: float = 0.0
) -> dict[str, Any]:
    import redis.asyncio as redis

    names = partitions("redis", parts)
    payload = b"x" * size
    host, port = address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port))
    await client.ping()
    started = time.time()
    for k, numbers in enumerate(_bursts(n, burst)):
        if k:
            await asyncio.sleep(pause)
        for first in range(numbers.start, numbers.stop, REDIS_PIPELINE):
            pipe = client.pipeline(transaction=False)
            for i in range(first, min(first + REDIS_PIPELINE, numbers.stop)):
                pipe.publish(names[i % parts], payload)
            await pipe.execute()
    seconds = time.time() - started
    await client.aclose()
    return {"published": n, "started_at": started, "seconds": seconds}


SUBSCRIBERS: dict[str, Callable[[str, int], Any]] = {
    "broky": _broky_sub, "nats": _nats_sub, "redis": _redis_sub,
}  # fmt: skip
PUBLISHERS: dict[str, Callable[[str, int, int, int, int, float], Any]] = {
    "broky": _broky_pub, "nats": _nats_pub, "redis": _redis_pub,
}  # fmt: skip


# ------------------------------------------------------------ runs


def client(
    procs: list[roles.Role], role: str, system: str, address: str, n: int, parts: int, size: int,
    check: bool = False, burst: int = 0, pause: float = 0.0,
) -> roles.Role:  # fmt: skip
    """A publisher ("pub") or a subscriber ("sub", ready) of `system`'s clients, a role process."""
    argv = ["--role", f"{clients_of(system)}:{role}", "--address", address, "--messages", str(n),
            "--partitions", str(parts), "--size", str(size), "--burst", str(burst), "--pause", str(pause),
            *(["--check"] if check else []),
            *(["--tls-ca", servers.tls_files()[0]] if system in TLS_SYSTEMS else [])]  # fmt: skip
    env = {ENV_AUTH: USERS_AUTH} if system == "broky_users" else None
    what = f"{system}: the {'subscriber' if role == 'sub' else 'publisher'}"
    return roles.start(procs, "bench.sdk_burst", *argv, ready=None if role == "pub" else roles.READY, env=env,
                       what=what)  # fmt: skip


def _start(system: str, workers: int) -> servers.Server:
    if system in TLS_SYSTEMS:
        _, cert, key = servers.tls_files()
        if system == "broky_tls":
            return servers.start_broky(workers, ["--tls-cert", cert, "--tls-key", key])
        return servers.start_nats(extra=["--tls", "--tlscert", cert, "--tlskey", key])
    if system == "broky":
        return servers.start_broky(workers)
    if system == "broky_users":
        server = servers.start_broky(workers, ["--users", _users_file()])
        server.auth = USERS_AUTH  # its HTTP port wants the user's credentials
        return server
    if system in VARIANTS:
        return servers.start_broky(workers, VARIANTS[system][1])
    return servers.STARTERS[system]()


def one_run(
    system: str, n: int, workers: int, parts: int = 256, size: int = 100, check: bool = False,
    burst: int = 0, pause: float = 0.0, warm: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """One burst of `n` messages through `system`'s server and clients, on a fresh server
    (check: every message checked, see the header; Broky only; burst, warm: see the header)."""
    if check and (clients_of(system) != "broky" or size < _head.size):
        raise ValueError(f"check mode is for Broky and payloads of {_head.size} B or more")
    server = _start(system, workers)
    procs: list[roles.Role] = []
    replay: dict[str, Any] = {}
    warm_cpu = 0.0
    try:
        address = f"{server.host}:{server.port}"
        if warm:  # published to nobody: Broky's replay buffer keeps them (and evicts the oldest)
            warm_cpu0 = procstat.total_exact_cpu_seconds(server.pids())
            client(procs, "pub", system, address, warm, parts, size).finish(None, timeout=600)
            # The server's CPU per message published to nobody (Broky: retained all the same).
            warm_cpu = procstat.total_exact_cpu_seconds(server.pids()) - warm_cpu0
        replay["before"] = _replay_stats(system, server)
        sub = client(procs, "sub", system, address, n, parts, size, check, burst, pause)
        pids = server.pids()
        for pid in pids:
            procstat.reset_peak_rss(pid)
        # The machine's CPU, and ours: the server's, the clients' (the publisher's whole life,
        # the subscriber's from now on), to tell what the rest of the machine used meanwhile.
        clients0 = procstat.children_cpu_seconds() + sub.cpu_seconds()
        busy0, all0, steal0 = procstat.machine_cpu()
        cpu0 = procstat.total_exact_cpu_seconds(pids)
        faults0 = sum(procstat.minor_faults(pid) for pid in pids)
        kernel0 = sum(procstat.system_cpu_seconds(pid) for pid in pids)
        pub = client(procs, "pub", system, address, n, parts, size, check, burst, pause)
        published = pub.finish(None, timeout=600)
        subscribed = sub.finish(None, timeout=600)
        pids = server.pids()
        cpu = procstat.total_exact_cpu_seconds(pids) - cpu0
        faults = sum(procstat.minor_faults(pid) for pid in pids) - faults0
        kernel = sum(procstat.system_cpu_seconds(pid) for pid in pids) - kernel0
        busy1, all1, steal1 = procstat.machine_cpu()
        clients = procstat.children_cpu_seconds() - clients0
        peak = sum(procstat.peak_rss_bytes(pid) for pid in pids)
        replay["after"] = _replay_stats(system, server)
    finally:
        roles.kill_all(procs)
        server.stop()
    received = subscribed["received"]
    after = subscribed["last_at"] - published["started_at"]
    cores = (all1 - all0) or 1.0  # CPU-seconds the machine had over the run
    return {
        **published,
        **subscribed,
        "lost": published["published"] - received,
        "delivered_after_s": round(after, 3),
        "deliveries_per_s": round(received / after) if after > 0 else None,
        "server_cpu_s": round(cpu, 4),  # includes QUIET idle seconds (a few ms for any of them)
        "server_cpu_us_per_delivery": round(cpu / max(received, 1) * 1e6, 3),
        "server_peak_rss_mb": round(peak / 1e6, 1),
        "server_minor_faults": faults,  # pages the server touched afresh (bench.harness.procstat)
        "server_kernel_cpu_s": round(kernel, 2),  # of server_cpu_s, in the kernel (in clock ticks)
        # The share of the machine's CPU (all cores) that other processes used during the run,
        # and what the hypervisor gave to other VMs (steal).
        "others_cpu_share": round(max(0.0, (busy1 - busy0) - cpu - clients) / cores, 3),
        "steal_share": round((steal1 - steal0) / cores, 3),
        **({"replay": replay} if replay["after"] is not None else {}),
        # The server's CPU per message of the warm-up, published to nobody (Broky: retained all the same).
        **({"warm_server_cpu_us_per_message": round(warm_cpu / warm * 1e6, 3)} if warm else {}),
    }


REPLAY_KEYS = ("replay_bytes", "replay_segments", "replay_messages", "replay_evicted_messages")
# What readers past their bound took from the buffers: times a connection began to lag, messages
# sent from history, messages evicted before they were read (broky/server/shard/lag.py).
LAG_KEYS = ("lag_entered", "lag_served", "lag_evicted")


def _replay_stats(system: str, server: servers.Server) -> dict[str, int] | None:
    """Broky's replay buffers and what lagging readers took from them, summed over the workers
    (/stats), or None for the others."""
    return server.workers_sum(*REPLAY_KEYS, *LAG_KEYS) if clients_of(system) == "broky" else None


def run(
    runs: int, n: int, workers: int, systems: Sequence[str] = SYSTEMS, parts: int = 256, size: int = 100,
    on_run: Callable[[str, int, dict[str, Any]], None] | None = None, burst: int = 0, pause: float = 0.0,
    warm: int = 0,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """`runs` bursts per system, the systems in turn (their order reversed every other run)."""
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(runs):
        for system in options.alternating(systems, r):
            try:
                got = one_run(system, n, workers, parts, size, burst=burst, pause=pause, warm=warm)
            except (servers.ServerError, RuntimeError, OSError, ValueError) as exc:
                got = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            results[system].append(got)
            if on_run is not None:
                on_run(system, r, got)
    return results


# (id, title, key_partitions, payload bytes) of the headline rows of `python -m bench`
MATRIX = (
    ("p1_100", "1 key_partition, 100 B", 1, 100),
    ("p256_100", "256 key_partitions, 100 B", 256, 100),
    ("p1_1024", "1 key_partition, 1 KiB", 1, 1024),
    ("p256_1024", "256 key_partitions, 1 KiB", 256, 1024),
)


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system: medians over its runs, the worst loss and the errors, if any."""
    out: dict[str, dict[str, Any]] = {}
    for system, runs in results.items():
        ok = [x for x in runs if "published" in x]
        errors = [x["error"] for x in runs if x.get("error")]
        if not ok:
            out[system] = {"error": errors[0] if errors else "no run"}
            continue

        def med(key: str, ok: list[dict[str, Any]] = ok) -> float:
            return float(statistics.median(x[key] for x in ok if x.get(key) is not None))

        out[system] = {
            "received_worst": min(x["received"] for x in ok),
            "lost_worst": max(x["lost"] for x in ok),
            # what the subscriber lost and was not told of (Broky's on_loss; None for the others)
            "untold_worst": max(x["lost"] - x["told_lost"] for x in ok) if "told_lost" in ok[0] else None,
            "published": ok[0]["published"],
            "publish_s": med("seconds"),
            "delivered_after_s": med("delivered_after_s"),
            "deliveries_per_s": med("deliveries_per_s"),
            "server_cpu_us_per_delivery": med("server_cpu_us_per_delivery"),
            "server_cpu_us_per_delivery_min": min(x["server_cpu_us_per_delivery"] for x in ok),
            "server_cpu_us_per_delivery_max": max(x["server_cpu_us_per_delivery"] for x in ok),
            "server_peak_rss_mb": med("server_peak_rss_mb"),
            "others_cpu_share_max": max((x.get("others_cpu_share") or 0.0) for x in ok),
            **{k: med(k) for k in ("warm_server_cpu_us_per_message",) if k in ok[0]},
            "errors": errors,
        }
    return out


def paired_ratios(results: dict[str, list[dict[str, Any]]], a: str, b: str, key: str) -> list[float]:
    """Per round, a's figure over b's (the two ran back to back: drift hits both alike);
    rounds where either failed are left out."""
    out = []
    for x, y in zip(results.get(a, []), results.get(b, []), strict=False):
        if x.get(key) and y.get(key):
            out.append(x[key] / y[key])
    return out


def spread(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every run's server CPU per delivered message, round by round, with Broky's ratio to
    each other system in the same round, and how busy the rest of the machine was."""
    key = "server_cpu_us_per_delivery"
    systems = list(results)
    first = systems[0]
    others = systems[1:]
    rounds = max(len(v) for v in results.values())
    head = ["round", *(TITLES[s] for s in systems), *(f"{TITLES[first]} / {TITLES[o]}" for o in others)]
    rows: list[list[Any]] = []
    for r in range(rounds):
        runs = [results[s][r] if r < len(results[s]) else {} for s in systems]
        cells = [f"{x[key]:.3f}" if x.get(key) else "-" for x in runs]
        for o in others:
            x, y = runs[0].get(key), results[o][r].get(key) if r < len(results[o]) else None
            cells.append(f"{x / y:.3f}" if x and y else "-")
        busy = max((x.get("others_cpu_share") or 0.0) for x in runs)
        rows.append([r + 1, *cells, f"{busy:.0%}"])
    cells = []
    for s in systems:
        values = [x[key] for x in results[s] if x.get(key)]
        cells.append(
            f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})" if values else "-"
        )
    for o in others:
        ratios = paired_ratios(results, first, o, key)
        cells.append(
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
        )
    rows.append(["median (min-max)", *cells, ""])
    return [
        f"Server CPU per delivered message (µs), every run, round by round; {TITLES[first]}'s ratio to "
        "each other system in the same round; the largest share of the machine's CPU that other "
        "processes used during a run of the round (a shared machine: other users' work).",
        "",
        *table([*head, "others' CPU"], rows),
    ]


def every_run(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every run's figures, as JSON, system by system."""
    runs = [f"{system}: {json.dumps(x)}" for system, xs in results.items() for x in xs]
    return ["Every run:", "", "```", *runs, "```"]


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    summary = summarize(results)
    systems = list(results)
    peers = [s for s in systems if s != "broky"]
    command = (
        f"python -m bench.sdk_burst --messages {args.messages} --runs {args.runs} "
        f"--workers {args.workers} --systems {','.join(systems)} --partitions {args.partitions} "
        f"--size {args.size}"
        + (f" --burst {args.burst} --pause {args.pause}" if args.burst else "")
        + (f" --warm {args.warm}" if args.warm else "")
        + (f" --name {args.name}" if args.name != "sdk_burst" else "")
    )
    title = "A burst, SDK to SDK, default settings: " + " vs ".join(TITLES[s] for s in systems)
    lines = [
        *heading(title, info, command),
        f"One asyncio publisher process publishes {args.messages:,} messages of {args.size:,} B over "
        f"{args.partitions} key_partition(s)"
        + (f", in bursts of {args.burst:,} with {args.pause} s between them," if args.burst else "")
        + (
            f" after {args.warm:,} of the same published to nobody on the fresh server (they fill Broky's "
            "replay buffer: the burst meets it full, evicting)"
            if args.warm
            else ""
        )
        + f" and flushes (redis-py: pipelined {REDIS_PIPELINE:,} per "
        "round trip); one asyncio subscriber process reads with a wildcard subscription and `async for`. "
        f"Defaults everywhere"
        + "".join(f" (but {TITLES[s]}: `{' '.join(VARIANTS[s][1])}`)" for s in systems if s in VARIANTS)
        + f". Broky with {args.workers} workers. Medians of {args.runs} runs, the systems alternating.",
        "",
    ]
    figures: list[tuple[str, str, str]] = [
        ("received (worst run)", "received_worst", "{:,.0f}"),
        ("lost (worst run)", "lost_worst", "{:,.0f}"),
        ("publisher: publish + flush (s)", "publish_s", "{:.2f}"),
        ("subscriber had the last message after (s)", "delivered_after_s", "{:.2f}"),
        ("deliveries per second", "deliveries_per_s", "{:,.0f}"),
        ("server CPU per delivered message (µs)", "server_cpu_us_per_delivery", "{:.2f}"),
        ("server peak RSS (MB)", "server_peak_rss_mb", "{:.1f}"),
    ]
    if args.warm:
        warm_row = "warm-up: server CPU per message published to nobody (µs)"
        figures.append((warm_row, "warm_server_cpu_us_per_message", "{:.2f}"))
    rows = []
    for name, key, fmt in figures:
        values = {s: summary[s].get(key) for s in systems}
        cells = [fmt.format(values[s]) if values[s] is not None else "-" for s in systems]
        ratios = []
        for p in peers:
            b, n = values.get("broky"), values.get(p)
            ratios.append(f"{b / n:.2f}x" if b is not None and n and key not in ("lost_worst",) else "-")
        rows.append([name, *cells, *ratios])
    head = ["", *(TITLES[s] for s in systems), *(f"Broky / {TITLES[p]}" for p in peers)]
    lines += [*table(head, rows), "", *spread(results), "", *every_run(results), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(
        "bench.sdk_burst", __doc__, out=options.RESULTS, runs=3, systems=",".join(SYSTEMS), workers=2,
        name="sdk_burst", role=True,
        helps={"systems": "comma-separated, of broky,nats,redis and the variants: "
               + ",".join([*VARIANTS, *TLS_SYSTEMS])},
    )  # fmt: skip
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--partitions", type=int, default=256, help="key_partitions (NATS, Redis: subjects)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes")
    parser.add_argument("--burst", type=int, default=0, help="messages per burst (0: one burst)")
    parser.add_argument("--pause", type=float, default=0.01, help="seconds between bursts")
    parser.add_argument(
        "--warm", type=int, default=0, help="messages published to nobody before the burst (see the header)"
    )
    options.role_options(parser, "address", "tls_ca", check=bool)
    args = parser.parse_args(argv)
    if args.role:
        global _tls_ca, QUIET
        _tls_ca = args.tls_ca
        if _tls_ca is not None:
            QUIET = TLS_QUIET
        system, role = args.role.split(":")
        import uvloop

        shape = (args.messages, args.partitions, args.size)
        if args.check:  # Broky only (one_run says so)
            if role == "sub":
                return roles.done(uvloop.run(_broky_sub(args.address, *shape, True)))
            return roles.done(uvloop.run(_broky_pub(args.address, *shape, args.burst, args.pause, True)))
        if role == "sub":
            return roles.done(uvloop.run(SUBSCRIBERS[system](args.address, args.messages)))
        return roles.done(uvloop.run(PUBLISHERS[system](args.address, *shape, args.burst, args.pause)))
    systems = options.systems(parser, args.systems, [*SYSTEMS, *VARIANTS, *TLS_SYSTEMS])
    info = machine_info()

    def show(system: str, r: int, got: dict[str, Any]) -> None:
        print(f"run {r + 1}, {system}: {got}", flush=True)

    results = run(
        args.runs, args.messages, args.workers, systems, args.partitions, args.size, show,
        args.burst, args.pause, args.warm,
    )  # fmt: skip
    write_results(args.out, args.name, report(results, args, info), info, args, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
