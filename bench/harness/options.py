"""The command line of every benchmark program: one parent parser with the options they share.

`parser(module, doc, ...)` makes `python -m MODULE`'s parser, its description the
first line of the program's docstring, with those of the shared options the
program takes, each at the program's default; the program then adds its own.

    --out DIR       where the results go (bench/results unless the program says otherwise)
    --runs N        runs of every case, the systems or setups alternating (`alternating`)
    --systems A,B   which systems, comma-separated (`systems` splits and checks them)
    --workers N     Broky's workers
    --quick         tiny sizes: the CI smoke run
    --name NAME     the results' file name, without .md/.json
    --role NAME     hidden: the program started again as one of its client processes
                    (bench/harness/roles.py), with the hidden options `role_options` adds

`command(module, argv)` is the command line that reproduces a run, as its
report quotes it: without `--out` (a directory of this machine's).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
RESULTS = Path(__file__).resolve().parents[1] / "results"
# The shared options: name -> (type, help). --quick is a flag (its value here: its help).
SHARED: dict[str, tuple[type, str]] = {
    "out": (Path, "output directory (default: bench/results)"),
    "runs": (int, "runs of each case, alternating"),
    "systems": (str, "comma-separated"),
    "workers": (int, "Broky's workers"),
    "quick": (bool, "tiny sizes (the CI smoke run)"),
    "name": (str, "the results' file name, without .md/.json"),
}


def parser(
    module: str,
    doc: str | None,
    *,
    role: Sequence[str] | bool = False,
    helps: dict[str, str] | None = None,
    **defaults: Any,
) -> argparse.ArgumentParser:
    """`python -m MODULE`'s parser with the shared options named in `defaults`, each at the
    default given (--quick: True to take it), in SHARED's order; `helps`: other helps
    than SHARED's; `role`: the hidden --role, with its role names (True: any)."""
    unknown = set(defaults) - set(SHARED)
    if unknown:
        raise ValueError(f"not shared options: {sorted(unknown)}")
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").strip().split("\n")[0])
    for name, (kind, help_) in SHARED.items():
        if name not in defaults:
            continue
        flag, help_ = f"--{name}", (helps or {}).get(name, help_)
        if kind is bool:
            p.add_argument(flag, action="store_true", help=help_)
        else:
            p.add_argument(flag, type=kind, default=defaults[name], help=help_)
    if role:
        p.add_argument("--role", choices=None if role is True else list(role), help=argparse.SUPPRESS)
    return p


def role_options(p: argparse.ArgumentParser, *names: str, **typed: type) -> None:
    """Hidden options of the program's role processes: `names` as strings, `typed` with a
    type (an underscore in a name is a dash on the command line; bool: a flag)."""
    for n in names:
        p.add_argument(f"--{n.replace('_', '-')}", help=argparse.SUPPRESS)
    for n, kind in typed.items():
        flag = f"--{n.replace('_', '-')}"
        if kind is bool:
            p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, type=kind, help=argparse.SUPPRESS)


def systems(p: argparse.ArgumentParser, given: str, known: Iterable[str]) -> list[str]:
    """The comma-separated `given` systems, each one of `known` (else the parser's error)."""
    chosen = [s for s in given.split(",") if s]
    unknown = set(chosen) - set(known)
    if unknown:
        p.error(f"unknown systems: {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    return chosen


def given(argv: Sequence[str] | None) -> list[str]:
    """The arguments a program was given: `argv`, or the command line's."""
    return sys.argv[1:] if argv is None else list(argv)


def command(module: str, argv: Sequence[str] | None) -> str:
    """`python -m MODULE ARGS` as given, without `--out DIR` (a directory of this machine's)."""
    kept: list[str] = []
    skip = False
    for arg in given(argv):
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return shlex.join(["python", "-m", module, *kept])


def alternating(items: Sequence[T], r: int) -> list[T]:
    """Round `r`'s order of `items`: as given in even rounds, reversed in odd ones, so that
    drift on a shared machine hits every item alike."""
    return list(items) if r % 2 == 0 else list(reversed(items))
