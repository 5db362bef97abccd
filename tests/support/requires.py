"""Programs the tests start that do not come with the package: one rule for all of them.

`./run test` installs each (Debian packages: nats-server, redis-server, etcd-server,
`./run test` installs each (Debian packages: nats-server, redis-server, etcd-server,
prometheus, flatbuffers-compiler, chromium, curl, openssl, podman, runc, mmdebstrap). A
test that needs one calls `program(name)` first: outside CI a missing program skips the
test with a reason that says how to get it; in CI (the environment variable CI set
to true, as CI services do and `.ci/run` does) it fails the test, because a skipped
test there would hide a broken set-up as surely as a broken build.
"""

from __future__ import annotations

import os
import shutil

import pytest

# The Debian package each program comes from (what `./run test` installs).
PACKAGES = {
    "chromium": "chromium",
    "curl": "curl",
    "etcd": "etcd-server",
    "flatc": "flatbuffers-compiler",
    "mmdebstrap": "mmdebstrap",
    "nats-server": "nats-server",
    "openssl": "openssl",
    "podman": "podman",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "redis-server": "redis-server",
    "runc": "runc",
}


def in_ci() -> bool:
    """True when the environment says this is a CI run (CI=true, or 1)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def program(name: str) -> str:
    """The path of `name` on PATH; if it is missing, skip the calling test (fail it in CI)."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"{name} is not on PATH (Debian's {PACKAGES.get(name, name)}; ./run test installs it)"
    if in_ci():
        pytest.fail(f"{why}: in CI every test must run", pytrace=False)
    pytest.skip(why)
