"""No file of the repository names a directory of the machine it was made on.

Benchmark results, docs and code are read on other machines: a path into the
root user's home, someone's home directory, a work directory or the checkout's
own absolute path means nothing there (and says where the author worked). Results name their output directory
relative to the checkout (bench.harness.report).
"""

from __future__ import annotations

import re
import subprocess

from tests.support.paths import ROOT

# A quoted, or space- or start-of-line-led, absolute path under a home or a work directory.
MACHINE_PATH = re.compile(rb"""(?:^|[\s"'=(])/(?:root|home/[^/\s"']+|work|Users/[^/\s"']+)/""", re.MULTILINE)


def test_no_tracked_file_names_a_machine_directory() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
    ).stdout
    found: list[str] = []
    checkout = str(ROOT).encode()
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.suffix in {".png", ".so"}:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.splitlines(), 1):
            if MACHINE_PATH.search(line) or checkout in line:
                found.append(f"{name}:{number}: {line.decode(errors='replace').strip()[:160]}")
    assert not found, "machine paths in the repository:\n" + "\n".join(found[:40])
