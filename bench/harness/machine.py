"""What a benchmark ran on: CPU model, cores, memory, OS, Python and versions."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import broky
from bench.harness import peers


def _first_line(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return "not installed"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def nats_version() -> str:
    """The version of the nats-server the benchmarks run (`peers.nats_binary`)."""
    match = re.search(r"v?(\d+\.\d+\.\d+)", _first_line([peers.nats_binary(), "--version"]))
    return match.group(1) if match else "unknown"


def redis_version() -> str:
    """The version of the Redis-protocol server the benchmarks run (`peers.redis_binary`)."""
    match = re.search(r"v=(\S+)", _first_line([peers.redis_binary(), "--version"]))
    return match.group(1) if match else "unknown"


def broky_revision() -> str:
    """`git describe` of the checkout the harness runs from, if it is one, with
    "-dirty" when files other than the results under bench/results/ differ from it
    (the benchmarks write those; they say nothing about the code measured)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown"
    line = _first_line(["git", "-C", str(root), "describe", "--always"])
    if line in ("not installed", "unknown", ""):
        return "unknown"
    try:
        changed = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".",
             ":(exclude)bench/results"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return line
    return f"{line}-dirty" if changed.strip() else line


def machine_info() -> dict[str, Any]:
    """Everything a reader needs to judge the figures."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = -1.0
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_bytes": memory_bytes(),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "broky": f"{broky.__version__} ({broky_revision()})",
        "nats_server": nats_version(),
        "redis_server": redis_version(),
        "redis_name": peers.redis_name(peers.redis_binary()),
        "load_average_at_start": round(load, 2),
    }


def versions(*dists: str) -> dict[str, str]:
    """The installed version of each Python distribution ("not installed" if it is not)."""
    out = {}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def describe(info: dict[str, Any], with_peers: bool = True) -> str:
    """One line naming the machine and versions, for every result file; `with_peers=False`
    leaves out the default peers' versions (for a report that names the binaries it chose
    itself, like bench.latency's)."""
    text = (
        f"{info['cpu_model']}, {info['cores']} cores, {info['memory_bytes'] / 2**30:.1f} GiB, "
        f"{info['os']}, {info['python']}; Broky {info['broky']}"
    )
    if with_peers:
        redis = info.get("redis_name", "redis-server")
        text += f", nats-server {info['nats_server']}, {redis} {info['redis_server']}"
    return text
