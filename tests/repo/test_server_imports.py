"""What the server's processes load: each module they do not import is memory they do not keep.

Idle RSS with two workers went from 129.9 to 77.2 MB by leaving these out
(bench/README.md, "Idle memory"); a new import of any of them would bring
its megabytes back into every worker or the master.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# module -> why the server's processes must not load it
HEAVY = {
    "numpy": "flatbuffers' optional helpers (15 MB)",
    "prometheus_client": "the master renders /metrics itself",
    "broky.client": "the SDK",
    "urllib.request": "only `broky info` fetches over HTTP",
    "http.client": "idem",
    "hmac": "loaded by a server with an auth token, at its first Hello or request for a private endpoint",
}
WORKER_ONLY = {
    "argparse": "workers read a ServerConfig, they parse no flag",
    "ctypes": "loaded at the first heap trim",
}


def loaded(code: str, names: list[str]) -> list[str]:
    probe = f"import sys; {code}; print(' '.join(m for m in {names!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.timeout(60)
def test_a_worker_loads_nothing_it_does_not_use() -> None:
    assert loaded("import broky.server.worker.process", [*HEAVY, *WORKER_ONLY]) == []


@pytest.mark.timeout(60)
def test_the_master_of_broky_serve_loads_nothing_it_does_not_use() -> None:
    code = (
        "import broky.cli, broky.server.master.process, broky.server.http.monitor; "
        "broky.cli.build_parser('serve')"
    )
    assert loaded(code, list(HEAVY)) == []


@pytest.mark.timeout(60)
def test_numpy_stays_usable_after_the_server_loaded_flatbuffers() -> None:
    pytest.importorskip("numpy")
    code = "import broky.server, numpy; assert numpy.zeros(3).sum() == 0"
    assert loaded(code, ["numpy"]) == ["numpy"]


@pytest.mark.timeout(60)
def test_a_worker_loads_nothing_of_the_http_side_nor_of_the_master() -> None:
    probe = (
        "import sys, broky.server.worker.process; "
        "print(' '.join(m for m in sys.modules "
        "if m.startswith(('broky.server.http', 'broky.server.master'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
