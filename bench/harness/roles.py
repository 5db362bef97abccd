"""The client processes of a benchmark ("roles"): started, talked to, timed and stopped in one place.

A benchmark program whose clients must run in processes of their own (an SDK
publisher, a subscriber, the members of a group, SSE readers: so that none
shares a GIL or an event loop with another, or with the orchestrator that
measures them) starts itself again as `python -m bench.PROGRAM --role NAME ...`
(the hidden `--role` of bench/harness/options.py). Both sides of that
conversation live here.

The role process says it is ready with a line of its own (`ready`: "ready", or
the word its program chose, as bench.worker_kill's publisher says "publishing"
once it publishes), then answers the orchestrator's commands, one line on
stdin each, each answered with one line on stdout (`lines`, `answer`), until
"stop" or the end of stdin (`next_line` for one that only waits for it). Its
last line is one JSON object: its report (`done`).

The orchestrator starts a role with `start` (or `spawn` and, later, `ready`,
to let several start at once): `python -m` with the orchestrator's own Python,
from the checkout, in a session of its own (a signal for the benchmark's
terminal does not reach it; a SIGSTOP or a cut hits it alone), stdin and stdout
piped. `Role.say` and `Role.ask` send commands, `Role.finish` ends it and reads
its report, `Role.cpu_seconds` times it (utime + stime, bench/harness/procstat.py)
while it runs, and `kill_all` kills, by pid, every role of a run still running
when the run ends, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

from bench.harness import procstat

ROOT = Path(__file__).resolve().parents[2]
READY = "ready"
STOP = "stop"


class RoleError(RuntimeError):
    """A role process did not start, or did not report."""


# ---------------------------------------------------------------- the orchestrator's side


class Role:
    """One role process: `python -m MODULE ARGV...` (see the module's header)."""

    def __init__(self, module: str, *argv: str, env: Mapping[str, str] | None = None, what: str = "") -> None:
        self.what = what or f"{module} {' '.join(argv[:2])}"
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def ready(self, line: str = READY) -> Role:
        """Wait for the role's ready line; RoleError if it says anything else or ends."""
        assert self.proc.stdout is not None
        said = self.proc.stdout.readline().strip()
        if said != line:
            raise RoleError(f"{self.what} did not start (said {said!r})")
        return self

    def say(self, line: str) -> None:
        """Send one command line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        """The role's next line (an answer)."""
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, line: str) -> str:
        """Send one command; its one-line answer."""
        self.say(line)
        return self.read()

    def finish(self, line: str | None = STOP, timeout: float = 60.0) -> dict[str, Any]:
        """Send `line` (None: nothing; stdin is closed either way, which a role takes for
        "stop"), wait for the role to end, and return its report (its last line)."""
        out, _ = self.proc.communicate(None if line is None else line + "\n", timeout=timeout)
        try:
            return last_json(out)
        except (ValueError, IndexError) as exc:
            raise RoleError(f"{self.what} ended (exit {self.proc.returncode}) without a report") from exc

    def cpu_seconds(self) -> float:
        """utime + stime of the role process so far (0.0 once it is gone)."""
        return procstat.cpu_seconds(self.pid)

    def kill(self) -> None:
        """SIGKILL the role if it still runs, reap it and close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def spawn(module: str, *argv: str, env: Mapping[str, str] | None = None, what: str = "") -> Role:
    """Start a role process; `Role.ready` waits for it."""
    return Role(module, *argv, env=env, what=what)


def start(
    procs: list[Role],
    module: str,
    *argv: str,
    ready: str | None = READY,
    env: Mapping[str, str] | None = None,
    what: str = "",
) -> Role:
    """Start a role process, add it to the run's `procs` (for `kill_all`) and wait for its
    ready line (`ready`; None: do not wait)."""
    role = spawn(module, *argv, env=env, what=what)
    procs.append(role)
    return role if ready is None else role.ready(ready)


def kill_all(procs: Iterable[Role]) -> None:
    """SIGKILL every role of `procs` still running, and reap it."""
    for role in procs:
        role.kill()


def last_json(output: str) -> dict[str, Any]:
    """The JSON object on the last line of a role's output: its report."""
    result: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return result


def total_cpu_seconds(procs: Iterable[Role]) -> float:
    return procstat.total_cpu_seconds(role.pid for role in procs)


# ---------------------------------------------------------------- the role process's side


def ready(line: str = READY) -> None:
    """Say the role is ready (the orchestrator's `Role.ready` waits for this line)."""
    print(line, flush=True)


def answer(value: Any) -> None:
    """Answer a command: one line, a string as it is, anything else as JSON."""
    print(value if isinstance(value, str) else json.dumps(value), flush=True)


def done(report: Any) -> int:
    """The role's last line, its report (JSON); the exit status to return."""
    print(json.dumps(report), flush=True)
    return 0


def next_line() -> asyncio.Future[str]:
    """The next line on stdin ("" at its end), read in a thread: a future of the running loop."""
    return asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def lines() -> AsyncIterator[str]:
    """The orchestrator's commands, as they come, until "stop" or the end of stdin."""
    while True:
        line = (await next_line()).strip()
        if not line or line == STOP:
            return
        yield line


async def ready_then_go(line: str = READY) -> str:
    """Say the role is ready, then wait for the orchestrator's next line (its "go")."""
    ready(line)
    return (await next_line()).strip()
