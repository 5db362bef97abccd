"""The one bench harness: its parent parser, its tables, and role processes started, timed and killed.

The benchmark programs' own tests (tests/bench/) run them
end to end; these hold the shared pieces to their contract: the options a program takes
are the shared ones it names, at its defaults; a report quotes its command without the
machine's output directory; a table's alignment line matches its head; and a role
process is started, answers, reports, is timed, and is killed by pid however a run ends.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench import worker_kill
from bench.harness import options, roles, servers
from bench.harness.report import row, table


def test_a_table_has_its_head_its_alignment_and_a_line_per_row() -> None:
    lines = table(("", "Broky", "NATS"), [("deliveries/s", "1.2 M", 980), ("lost", 0, "")])
    assert lines == [
        "| | Broky | NATS |",
        "|---|---:|---:|",  # the first column left, the others right unless told
        "| deliveries/s | 1.2 M | 980 |",
        "| lost | 0 | |",
    ]
    assert table(("a", "b"), [], "rl")[1] == "|---:|---|"
    assert row(["x", 1.5]) == "| x | 1.5 |"
    with pytest.raises(ValueError, match="3 alignments for 2 columns"):
        table(("a", "b"), [], "lrr")


def test_a_program_takes_the_shared_options_it_names_at_its_defaults() -> None:
    p = options.parser("bench.x", "What it does.\n\nMore.", out=Path("o"), runs=3, quick=True, role=("pub",))
    args = p.parse_args([])
    assert (args.out, args.runs, args.quick, args.role) == (Path("o"), 3, False, None)
    assert p.description == "What it does." and p.prog == "python -m bench.x"
    assert p.parse_args(["--runs", "5", "--quick", "--role", "pub"]).runs == 5
    with pytest.raises(SystemExit):
        p.parse_args(["--systems", "broky"])  # not named: not taken
    with pytest.raises(SystemExit):
        p.parse_args(["--role", "sub"])  # a role it does not have
    with pytest.raises(ValueError, match="not shared options"):
        options.parser("bench.x", None, rounds=3)
    assert options.systems(p, "broky,,nats", ("broky", "nats", "redis")) == ["broky", "nats"]
    with pytest.raises(SystemExit):
        options.systems(p, "broky,kafka", ("broky", "nats"))


def test_a_report_quotes_its_command_without_the_output_directory() -> None:
    argv = ["--runs", "2", "--out", "/somewhere/of/this/machine", "--note", "two words", "--out=/x"]
    assert options.command("bench.x", argv) == "python -m bench.x --runs 2 --note 'two words'"
    assert options.alternating(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert options.alternating(["a", "b", "c"], 1) == ["c", "b", "a"]


@pytest.mark.timeout(60)
def test_a_role_is_started_ready_timed_and_reports_its_figures() -> None:
    server = servers.start_broky(1)
    procs: list[roles.Role] = []
    try:
        url = f"{server.host}:{server.port}"
        sub = worker_kill.start_subscriber(procs, url)
        pub = worker_kill.start_publisher(procs, url, rate=2000, partitions=4, duration=0.5)
        published = pub.finish(None, timeout=30)  # it ends by itself: nothing to say
        time.sleep(0.3)
        assert sub.cpu_seconds() > 0  # (the SDK's import alone takes some)
        subscribed = sub.finish()  # "stop", then its report, its last line
    finally:
        roles.kill_all(procs)
        server.stop()
    assert published["sent"] > 0 and published["flush_error"] is None
    assert len(subscribed["received"]) == published["sent"]
    assert all(role.poll() is not None for role in procs)


@pytest.mark.timeout(60)
def test_a_role_that_does_not_start_is_told_apart_and_every_role_is_killed_by_pid() -> None:
    server = servers.start_broky(1)
    url = f"{server.host}:{server.port}"
    procs: list[roles.Role] = []
    try:
        with pytest.raises(roles.RoleError, match="the subscriber did not start"):
            worker_kill.start_subscriber(procs, "127.0.0.1:1")  # nobody listens there: it ends
        with pytest.raises(roles.RoleError, match=r"did not start \(said 'publishing'\)"):
            argv = ("--role", "publisher", "--server", url, "--duration", "0", "--partitions", "4")
            roles.start(procs, "bench.worker_kill", *argv)  # it says "publishing", not "ready"
        waiting = worker_kill.start_subscriber(procs, url)  # until "stop"
        assert waiting.poll() is None
    finally:
        roles.kill_all(procs)  # however the run ends
        server.stop()
    assert all(role.poll() is not None for role in procs)
    assert not any(os.path.exists(f"/proc/{role.pid}") for role in procs)
