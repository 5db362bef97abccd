"""The replay buffer's memory: an idle server, a burst, a full buffer; with the default buffer and without.

    python -m bench.replay_memory [--rounds 3] [--workers 2] [--settle 4] [--fill 160000]

Every round starts two fresh `broky serve --workers 2`, one with the default
replay buffer (64 MiB per worker) and one with `--replay-bytes 0`, one after
the other (their order alternating from round to round), and on each:

1. idle: the RSS of every server process (master and workers) and their PSS,
   `--settle` seconds after the ready line (bytecode compiled beforehand, as
   bench/README.md's "Idle memory" requires);
2. the headline burst of bench.sdk_burst (300,000 messages of 100 B over 256
   key_partitions from an SDK publisher process to an SDK subscriber process
   on `cpu.>`): the server's peak RSS over it (VmHWM, every process);
3. small reads: 50,000 messages of 100 B over 256 key_partitions in bursts of
   10 with 1 ms between them (a publisher at about 8,000 msgs/s: each read of
   a worker holds a few messages, so the replay buffer keeps many small
   segments), with nobody subscribed; the RSS `--settle` seconds later;
4. a fill: `--fill` messages of 1 KiB over 256 key_partitions to nobody, more
   than the two workers' 2 x 64 MiB, so the buffers are full and evicting;
   the RSS `--settle` seconds later.

After each step the replay buffers' bytes, segments and messages (/stats)
are read too, so each RSS can be set against what the buffers hold: the
issue's rule is that the server's RSS grows by no more than the buffers'
own fill. Then, in this process, what a retained segment costs the Python
heap beyond its bytes (tracemalloc: the segment's object and bookkeeping,
the index's 8 bytes per message), for segments of 1, 5 and 500 messages;
and the arithmetic: how many seconds of what rate the default 64 MiB per
worker covers.

Results: bench/results/replay_memory.md and .json, with the machine.
"""

from __future__ import annotations

import argparse
import compileall
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import sdk_burst  # noqa: E402
from bench.harness import options, procstat, roles, servers  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402

CONFIGS = {"on": [], "off": ["--replay-bytes", "0"]}  # `broky serve` options of each configuration
TITLES = {"on": "replay buffer on (default, 64 MiB per worker)", "off": "`--replay-bytes 0`"}
PARTITIONS = 256
BURST = 300_000  # the headline burst: 100 B messages
SMALL = 50_000  # small reads: 100 B messages in bursts of SMALL_BURST, SMALL_PAUSE s apart
SMALL_BURST = 10
SMALL_PAUSE = 0.001
MiB = 1 << 20


def server_memory(server: servers.Server) -> dict[str, int]:
    """RSS of the master, of each worker and of all, and their PSS summed, in bytes."""
    pids = server.pids()
    rss = [procstat.rss_bytes(pid) for pid in pids]
    return {
        "rss": sum(rss),
        "rss_master": rss[0],
        "rss_workers": sum(rss[1:]),
        "pss": sum(procstat.pss_bytes(pid) for pid in pids),
    }


def replay_stats(server: servers.Server) -> dict[str, int]:
    return server.workers_sum(*sdk_burst.REPLAY_KEYS)


def _publish(
    procs: list[roles.Role], address: str, n: int, size: int, burst: int = 0, pause: float = 0.0
) -> None:
    sdk_burst.client(procs, "pub", "broky", address, n, PARTITIONS, size, burst=burst, pause=pause).finish(
        None, timeout=600
    )


def one_round(config: str, workers: int, settle: float, fill: int) -> dict[str, Any]:
    server = servers.start_broky(workers, CONFIGS[config])
    out: dict[str, Any] = {"config": config}
    procs: list[roles.Role] = []
    try:
        address = f"{server.host}:{server.port}"
        time.sleep(settle)
        out["idle"] = server_memory(server)
        # The headline burst, with its subscriber: the peak over it.
        sub = sdk_burst.client(procs, "sub", "broky", address, BURST, PARTITIONS, 100)
        for pid in server.pids():
            procstat.reset_peak_rss(pid)
        _publish(procs, address, BURST, 100)
        out["burst_received"] = sub.finish(None, timeout=600)["received"]
        out["burst_peak_rss"] = sum(procstat.peak_rss_bytes(pid) for pid in server.pids())
        time.sleep(settle)
        out["after_burst"] = {**server_memory(server), **replay_stats(server)}
        # Small reads, to nobody: many small segments.
        _publish(procs, address, SMALL, 100, SMALL_BURST, SMALL_PAUSE)
        time.sleep(settle)
        out["after_small"] = {**server_memory(server), **replay_stats(server)}
        # A fill past both buffers' limits.
        _publish(procs, address, fill, 1024)
        time.sleep(settle)
        out["after_fill"] = {**server_memory(server), **replay_stats(server)}
    finally:
        roles.kill_all(procs)
        server.stop()
    return out


# ------------------------------------------------------------ in this process


def segment_costs() -> list[dict[str, Any]]:
    """The Python heap a retained segment takes beyond its bytes, by messages per segment."""
    from broky.client.encoder import PublishEncoder
    from broky.server.shard.replay import ReplayBuffer
    from broky.server.shard.sequences import Sequences

    frame = PublishEncoder(1 << 20).encode(b"tenant-1", b"cpu.k", b"x" * 100, None)[0]
    out = []
    for per_segment, segments in ((1, 50_000), (5, 20_000), (500, 200)):
        data = frame * per_segment
        buffer = ReplayBuffer(1 << 40, Sequences())  # no bound, no budget: nothing evicted
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(segments):
            seg = buffer.retain(bytearray(data), i)
            for j in range(per_segment):
                buffer.record((i * per_segment + j) % PARTITIONS, seg, j * len(frame))
        buffer.settle()  # the log's entries into the index (the log waits for at most LOG_BYTES)
        traced = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        messages = segments * per_segment
        index = sum(len(ix) for ix in buffer.index)
        out.append({
            "messages_per_segment": per_segment,
            "frame_bytes": len(frame),
            "segments": segments,
            "counted_bytes": buffer.bytes,  # what --replay-bytes bounds
            "heap_bytes": traced,
            "index_bytes": index,
            "heap_over_counted": round(traced / buffer.bytes, 3),
            "overhead_per_segment": round((traced - buffer.bytes - index) / segments, 1),
            "index_per_message": round(index / messages, 1),
        })  # fmt: skip
    return out


def coverage() -> list[dict[str, Any]]:
    """How long the default buffer covers at a few rates, per worker (frames as the SDK encodes them)."""
    from broky.client.encoder import PublishEncoder
    from broky.server.config import DEFAULT_REPLAY_BYTES

    encoder = PublishEncoder(1 << 20)
    out = []
    for size in (100, 1024):
        frame = len(encoder.encode(b"tenant-1", b"cpu.k", b"x" * size, None)[0])
        messages = DEFAULT_REPLAY_BYTES // frame  # read segments hold little else but frames
        for rate in (10_000, 100_000):
            out.append({"payload": size, "frame": frame, "messages": messages, "rate_per_worker": rate,
                        "seconds": round(messages / rate, 1)})  # fmt: skip
    return out


# ------------------------------------------------------------ report


def _mb(v: float) -> str:
    return f"{v / 1e6:,.1f}"


def summarize(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per configuration, the median of every figure over the rounds."""
    figures: dict[str, dict[str, list[float]]] = {c: {} for c in CONFIGS}
    for r in rounds:
        f = figures[r["config"]]
        for step in ("idle", "after_burst", "after_small", "after_fill"):
            for k, v in r[step].items():
                f.setdefault(f"{step}.{k}", []).append(v)
        f.setdefault("burst_peak_rss", []).append(r["burst_peak_rss"])
    return {c: {k: float(statistics.median(v)) for k, v in f.items()} for c, f in figures.items() if f}


def report(result: dict[str, Any], args: argparse.Namespace, info: dict[str, Any]) -> str:
    rounds = result["rounds"]
    med = summarize(rounds)
    on, off = med["on"], med["off"]
    command = (
        f"python -m bench.replay_memory --rounds {args.rounds} --workers {args.workers} "
        f"--settle {args.settle} --fill {args.fill}"
    )
    lines = [
        *heading("The replay buffer's memory: idle, over a burst, full", info, command),
        f"`broky serve --workers {args.workers}`, fresh per round and configuration, the two configurations "
        f"alternating; medians of {args.rounds} rounds. RSS and PSS summed over every server process (master "
        f"and workers), in MB (10^6 bytes), read {args.settle} s after each step. The replay buffers' bytes "
        "are what `--replay-bytes` bounds (the retained reads), from /stats.",
        "",
    ]
    rows = [
        ("idle RSS", "idle.rss"),
        ("idle RSS, master", "idle.rss_master"),
        ("idle RSS, workers", "idle.rss_workers"),
        ("idle PSS", "idle.pss"),
        (f"peak RSS over the burst ({BURST:,} x 100 B, 256 key_partitions, SDK to SDK)", "burst_peak_rss"),
        ("RSS after the burst", "after_burst.rss"),
        ("replay buffers after the burst", "after_burst.replay_bytes"),
        (f"RSS after {SMALL:,} more in small reads ({SMALL_BURST} per burst)", "after_small.rss"),
        ("replay buffers then", "after_small.replay_bytes"),
        (f"RSS after a fill of {args.fill:,} x 1 KiB (buffers full)", "after_fill.rss"),
        ("replay buffers then", "after_fill.replay_bytes"),
    ]
    cells = [
        (t, _mb(a), _mb(b), _mb(a - b)) for t, a, b in ((t, on.get(k, 0.0), off.get(k, 0.0)) for t, k in rows)
    ]
    lines += table(("", TITLES["on"], TITLES["off"], "on - off"), cells)
    idle_growth = on["idle.rss"] - off["idle.rss"]
    lines += [
        "",
        "The rule (the issue): idle RSS grows by no more than the buffer's own fill.",
        "",
        f"- Idle, the buffers hold nothing: RSS on - off = {_mb(idle_growth)} MB.",
    ]
    for step, title in (("after_burst", "after the burst"), ("after_small", "after the small reads"),
                        ("after_fill", "with the buffers full")):  # fmt: skip
        grown = on[f"{step}.rss"] - off[f"{step}.rss"]
        held = on[f"{step}.replay_bytes"]
        own = on[f"{step}.rss"] - on["idle.rss"]
        lines.append(
            f"- {title.capitalize()}: RSS on - off = {_mb(grown)} MB for {_mb(held)} MB held in "
            f"{on[f'{step}.replay_segments']:,.0f} segments ({on[f'{step}.replay_messages']:,.0f} messages): "
            f"{grown / held:.2f}x the fill; on over its own idle RSS {_mb(own)} MB ({own / held:.2f}x; off "
            f"over its own: {_mb(off[f'{step}.rss'] - off['idle.rss'])} MB, the heap the same traffic left)."
            if held
            else f"- {title}: nothing held."
        )
    lines += [
        "",
        "What a retained segment costs the Python heap (tracemalloc, in this process; a segment is one "
        "stamped read, kept whole): its bytes are what `--replay-bytes` counts; beyond them, the segment's "
        "object and the buffer's bookkeeping per segment, and the index's 8 bytes per message (and, "
        "for a moment, 16 bytes per message in the log: at most LOG_BYTES, 256 KiB, per worker).",
        "",
        *table(
            ("messages per segment", "frame (B)", "heap / counted bytes", "bookkeeping per segment (B)",
             "index per message (B)"),
            [(s["messages_per_segment"], s["frame_bytes"], f"{s['heap_over_counted']:.2f}x",
              f"{s['overhead_per_segment']:.0f}", f"{s['index_per_message']:.0f}")
             for s in result["segments"]],
            "rrrrr",
        ),
    ]  # fmt: skip
    lines += [
        "",
        "What the default 64 MiB per worker covers (frames as the SDK encodes them, key `cpu.k`, "
        "key_partition `tenant-1`; a server with W workers and its key_partitions spread evenly over them "
        "covers the same seconds at W times the rate):",
        "",
        *table(
            ("payload", "frame (B)", "messages per worker", "rate per worker (msgs/s)", "seconds"),
            [(f"{c['payload']:,} B", f"{c['frame']:,}", f"{c['messages']:,}", f"{c['rate_per_worker']:,}",
              f"{c['seconds']:,}") for c in result["coverage"]],
            "rrrrr",
        ),
    ]  # fmt: skip
    lines += ["", "Every round:", "", "```"]
    lines += [json.dumps(r) for r in rounds]
    lines += ["```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.replay_memory", __doc__, out=options.RESULTS, workers=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=4.0, help="seconds before each reading")
    parser.add_argument("--fill", type=int, default=160_000, help="1 KiB messages of the fill")
    args = parser.parse_args(argv)
    compileall.compile_dir(ROOT / "broky", quiet=1)  # idle RSS with bytecode compiled (bench/README.md)
    info = machine_info()
    rounds = []
    for r in range(args.rounds):
        for config in options.alternating(("on", "off"), r):
            got = one_round(config, args.workers, args.settle, args.fill)
            print(f"round {r + 1}, {config}: {got}", flush=True)
            rounds.append(got)
    result = {"rounds": rounds, "segments": segment_costs(), "coverage": coverage()}
    write_results(args.out, "replay_memory", report(result, args, info), info, args, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
