"""`python -m bench.full_run`: every benchmark the README quotes, one after another, at one commit.

The README's figures must come from one run at one commit on one machine, named
(issue 28): a headline from one day beside client rows from another CPU, at
commits marked -dirty, cannot be compared. This runs each benchmark whose
results the README cites, in sequence (each starts and stops its own servers;
nothing runs beside them), each with the command the README gives to
reproduce it, writing into bench/results as each does by default. Then it
writes full_run.md and full_run.json there: the commit, the machine, and for
every step its command, start, wall time and exit status.

It refuses a tree with uncommitted changes outside bench/results, the same
test that marks a result file's revision -dirty (`--allow-dirty` to run anyway:
the report then says -dirty, as every result file does). `--only` and `--skip`
run some steps: the benchmarks still write their own results, but the run's
report goes to standard output instead of full_run.md, which names only
complete runs. A failing step does not stop the others; the exit status is 1
if any failed. It takes about an hour and a half on the 2-core machine
(`--list` shows the steps); `--latency-duration` shortens the latency
matrix's runs (its default is 10 s, about 56 minutes).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import machine, options
from bench.harness.report import table, write_results

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    args: tuple[str, ...]  # after `python -m`
    results: str  # the files it writes, for the report
    what: str


def steps(latency_duration: float | None) -> list[Step]:
    latency: tuple[str, ...] = ("bench.latency",)
    if latency_duration is not None:
        latency += ("--duration", f"{latency_duration:g}", "--out", "bench/results")
    burst = ("bench.sdk_burst", "--messages", "300000", "--runs", "7", "--systems")
    lag = (
        "bench.sdk_burst",
        "--systems",
        "broky,nats,redis",
        "--runs",
        "3",
        "--size",
        "1024",
        "--partitions",
    )
    return [
        Step(
            "bench", ("bench",), "bench.md, *.png", "the headline: SDK to SDK, pre-encoded publishes, latency"
        ),
        Step("latency", latency, "latency.md, latency_*.png", "the latency matrix with the compiled probe"),
        Step(
            "sdk_bench",
            ("bench.sdk_bench",),
            "sdk.md",
            "SDK publish, bulk publish, end to end in one process",
        ),
        Step("sdk_burst", ("bench.sdk_burst",), "sdk_burst.md", "one SDK-to-SDK burst, 256 key_partitions"),
        Step(
            "replay_fresh",
            (*burst, "broky,broky_noreplay,nats,redis", "--name", "replay_p256_100"),
            "replay_p256_100.md",
            "the replay buffer's cost on a fresh server",
        ),
        Step(
            "replay_full",
            (*burst, "broky,broky_noreplay,nats", "--warm", "600000", "--name", "replay_p256_100_full"),
            "replay_p256_100_full.md",
            "the replay buffer's cost once it has filled",
        ),
        Step(
            "metrics_overhead", ("bench.metrics_overhead",), "metrics_overhead.md", "/metrics scraped or not"
        ),
        Step("memory_budget", ("bench.memory_budget",), "memory_budget.md", "100 stalled subscribers"),
        Step(
            "lag_burst_1k_256",
            (*lag, "256", "--name", "lag_burst_1k_256"),
            "lag_burst_1k_256.md",
            "a slow reader catches up from history: the 1 KiB burst, 256 key_partitions",
        ),
        Step(
            "lag_burst_1k_1",
            (*lag, "1", "--name", "lag_burst_1k_1"),
            "lag_burst_1k_1.md",
            "the same, 1 key_partition (what does not fit in the buffer is told)",
        ),
        Step("chaos", ("bench.chaos",), "chaos.md", "servers, nodes and etcd killed, frozen, wiped"),
        Step(
            "kill_loop_flush",
            ("bench.kill_loop_flush",),
            "kill_loop_flush.md",
            "a node kill loop under clients that flush every second: their CPU",
        ),
        Step("worker_kill", ("bench.worker_kill",), "worker_kill.md", "a worker SIGKILLed 10 times"),
        Step(
            "worker_kill_stalled",
            ("bench.worker_kill", "--payload-bytes", "4096", "--stall-subscriber", "1.5"),
            "worker_kill_stalled.md",
            "the same with a stalled subscriber",
        ),
        Step(
            "cluster_failover", ("bench.cluster_failover",), "cluster_failover.md", "a node of three killed"
        ),
        Step(
            "cluster_drain",
            ("bench.cluster_drain",),
            "cluster_drain.md",
            "rolling restarts, the leader's too",
        ),
        Step(
            "cluster_cpu", ("bench.cluster_cpu", "--runs", "5"), "cluster_cpu.md", "cluster CPU per delivery"
        ),
        Step("micro", ("bench.micro_report",), "micro.md", "codec micro-benchmarks"),
        Step("spark_sink", ("bench.spark_bench",), "spark.md", "the Spark sink"),
        Step("spark_source", ("bench.spark_source",), "spark_source.md", "the Spark source"),
    ]


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_step(step: Step, logs: Path) -> dict[str, Any]:
    log = logs / f"{step.name}.log"
    started = time.monotonic()
    when = datetime.datetime.now(datetime.UTC).strftime("%H:%M UTC")
    print(f"[{when}] {step.name}: python -m {' '.join(step.args)}", file=sys.stderr, flush=True)
    with log.open("wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", *step.args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    elapsed = time.monotonic() - started
    result = {
        "name": step.name,
        "command": "python -m " + " ".join(step.args),
        "started": when,
        "elapsed_s": round(elapsed, 1),
        "exit": proc.returncode,
        "results": step.results,
        "what": step.what,
    }
    if proc.returncode != 0:
        result["tail"] = _tail(log)
        print(f"  {step.name} failed (exit {proc.returncode}):\n{result['tail']}", file=sys.stderr)
    else:
        print(f"  {step.name}: {elapsed / 60:.1f} min", file=sys.stderr, flush=True)
    return result


def markdown(run: dict[str, Any]) -> str:
    lines = [
        "# The full run: every benchmark the README quotes (`python -m bench.full_run`)",
        "",
        f"Started {run['started']}, {run['elapsed_s'] / 60:.0f} minutes; commit {run['commit']}; "
        f"`{run['command']}`.",
        "",
        f"Machine: {machine.describe(run['machine'])}. Load average at the start: {run['load_start']}.",
        "",
        "Each step ran alone, in this order, and wrote the result files named beside it.",
        "",
        *table(
            ("Step", "Command", "Started", "Minutes", "Exit", "Results"),
            [(f"{s['name']}: {s['what']}", f"`{s['command']}`", s["started"], f"{s['elapsed_s'] / 60:.1f}",
              s["exit"], s["results"]) for s in run["steps"]],
            "lllrrl",
        ),
    ]  # fmt: skip
    failed = [s for s in run["steps"] if s["exit"] != 0]
    for s in failed:
        lines += ["", f"**{s['name']} failed** (exit {s['exit']}); the end of its output:", "", "```"]
        lines += [s.get("tail", ""), "```"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = options.parser("bench.full_run", __doc__)
    parser.add_argument("--only", help="comma-separated step names (see --list)")
    parser.add_argument("--skip", help="comma-separated step names")
    parser.add_argument(
        "--latency-duration", type=float, help="seconds per latency run (bench.latency's default: 10)"
    )
    parser.add_argument("--allow-dirty", action="store_true", help="run on a tree with uncommitted changes")
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    args = parser.parse_args(argv)
    given = options.given(argv)
    plan = steps(args.latency_duration)
    names = [s.name for s in plan]
    only = [n for n in (args.only or "").split(",") if n]
    skip = [n for n in (args.skip or "").split(",") if n]
    unknown = set(only + skip) - set(names)
    if unknown:
        parser.error(f"unknown steps: {', '.join(sorted(unknown))} (steps: {', '.join(names)})")
    if args.list:
        for s in plan:
            print(f"{s.name:20} python -m {' '.join(s.args)}")
        return 0
    chosen = [s for s in plan if (not only or s.name in only) and s.name not in skip]
    revision = machine.broky_revision()  # "-dirty" as every result file will say it
    if revision.endswith("-dirty") and not args.allow_dirty:
        print(f"{revision}: uncommitted changes (--allow-dirty to run anyway)", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="broky-full-run-"))
    print(f"logs in {logs}", file=sys.stderr)
    started = time.monotonic()
    info = machine.machine_info()
    run: dict[str, Any] = {
        "command": options.command("bench.full_run", given),
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": revision,
        "machine": info,
        "load_start": f"{os.getloadavg()[0]:.2f}",
        "steps": [],
    }
    for step in chosen:
        run["steps"].append(run_step(step, logs))
    run["elapsed_s"] = round(time.monotonic() - started, 1)
    text = markdown(run)
    if len(chosen) == len(plan):
        del run["machine"]
        write_results(options.RESULTS, "full_run", text, info, None, **run)
        print(f"wrote {options.RESULTS / 'full_run.md'}", file=sys.stderr)
    else:
        print(text)
    return 1 if any(s["exit"] != 0 for s in run["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
