"""`python -m bench.full_run`: its plan (the full run itself takes an hour and a half)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from bench import full_run
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)


def test_every_step_names_a_benchmark_module_and_a_results_file() -> None:
    plan = full_run.steps(None)
    assert len({s.name for s in plan}) == len(plan)
    for step in plan:
        assert importlib.util.find_spec(step.args[0]) is not None, step
        assert step.results.split(",")[0].endswith(".md"), step
    assert full_run.steps(4)[1].args == ("bench.latency", "--duration", "4", "--out", "bench/results")


def test_every_command_the_docs_cite_for_clients_and_integrations_is_a_step() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    section = page.split("\n## Clients and integrations\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    cited = {cmd for row in table[2:] for cmd in re.findall(r"`(python -m [^`]+)`", row.split("|")[-2])}
    commands = {"python -m " + " ".join(s.args) for s in full_run.steps(None)}
    assert cited and cited <= commands, sorted(cited - commands)


def test_list_and_unknown_steps() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "bench.full_run", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    listed = run("--list")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [s.name for s in full_run.steps(None)]
    unknown = run("--only", "bench,nonesuch")
    assert unknown.returncode == 2 and "unknown steps: nonesuch" in unknown.stderr
