"""A server bound beyond loopback without a credential (broky.server.security.exposure).

Real `broky serve` processes: refused on 0.0.0.0 (and ::, every interface) without
--auth-token or --users, exit status 2 and one line naming what to set; started with
--allow-unauthenticated, with a WARNING and broky_unauthenticated_public 1; started on
0.0.0.0 with a token or users; loopback unchanged. The container image's settings are
run the same way (without podman: tests/test_image.py runs the image itself).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

import broky
from broky.errors import BrokyConnectionError, ServerError
from broky.server.security.exposure import is_loopback
from broky.server.security.users import hash_password
from tests.support.paths import ROOT
from tests.support.serverproc import ServerProcess

QUICK = ("--port", "0", "--metrics-port", "0", "--workers", "1")
WARNING = "serving WITHOUT authentication beyond loopback (--allow-unauthenticated)"


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("BROKY_")}, **extra}


def refused(command: list[str], env: dict[str, str] | None = None) -> str:
    """The one line a `broky serve` that must not start exits 2 with. A server that
    starts instead is stopped (its process group, by its pid) and fails the test."""
    proc = subprocess.Popen(
        command,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{command} served instead of refusing: {out.decode()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 2, err.decode()
    line = err.decode()
    assert line.count("\n") == 1 and line.startswith("broky serve: error: "), line
    assert b"broky ready" not in out
    return line.removeprefix("broky serve: error: ").rstrip("\n")


def serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "broky", "serve", *QUICK, *args]


def scrape(server: ServerProcess, name: str) -> float:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    (value,) = re.findall(rf"^{name} (\S+)$", text, re.M)
    return float(value)


def stats(server: ServerProcess, token: str | None = None) -> dict[str, object]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.metrics_port}/stats")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        master = json.loads(answer.read())["master"]
    assert isinstance(master, dict)
    return master


def admitted(server: ServerProcess, **options: str) -> bool:
    """Whether a client on 127.0.0.1 gets through the handshake (the SDK's `connect`)."""
    try:
        with broky.connect_sync(f"127.0.0.1:{server.port}", connect_timeout=10, **options):
            return True
    except (ServerError, BrokyConnectionError):
        return False


# ---------------------------------------------------------------- what is loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1", "localhost"])
def test_loopback_addresses_and_names(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "", "10.0.0.7", "192.168.1.20", "fe80::1", "128.0.0.1", "nonexistent.invalid"]
)
def test_every_other_host_is_beyond_loopback(host: str) -> None:
    assert not is_loopback(host)


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_server_beyond_loopback_without_a_credential_refuses_to_start(host: str) -> None:
    line = refused(serve("--host", host))
    shown = host or "'' (every interface)"
    assert line.startswith(f"--host {shown} is not a loopback address and the server has no authentication")
    for named in ("--auth-token", "--users", "--host 127.0.0.1", "--allow-unauthenticated"):
        assert named in line, line


def test_the_host_from_the_environment_is_judged_too() -> None:
    line = refused(serve(), clean_env(BROKY_HOST="0.0.0.0"))
    assert line.startswith("--host 0.0.0.0 is not a loopback address"), line
    # the opt-out's variable set to no is no opt-out
    line = refused(serve(), clean_env(BROKY_HOST="0.0.0.0", BROKY_ALLOW_UNAUTHENTICATED="no"))
    assert "--allow-unauthenticated" in line


# ---------------------------------------------------------------- the opt-out


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_the_opt_out_serves_with_a_warning_a_metric_and_a_stats_field(
    how: str, start_server: Callable[..., ServerProcess]
) -> None:
    if how == "flag":
        server = start_server("--host", "0.0.0.0", "--allow-unauthenticated", workers=1)
    else:
        server = start_server("--host", "0.0.0.0", workers=1, env={"BROKY_ALLOW_UNAUTHENTICATED": "1"})
    assert server.host == "0.0.0.0"
    log = server.wait_log(WARNING)
    (line,) = [line for line in log.splitlines() if WARNING in line]
    assert " WARNING " in line and f"0.0.0.0:{server.port} (clients)" in line
    assert f":{server.metrics_port} (HTTP)" in line and "--auth-token or --users" in line
    assert scrape(server, "broky_unauthenticated_public") == 1
    assert stats(server)["unauthenticated_public"] is True
    assert admitted(server)


# ---------------------------------------------------------------- with a credential


def test_a_server_with_a_token_serves_beyond_loopback(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--host", "0.0.0.0", "--auth-token", "s3cret", workers=1)
    assert scrape(server, "broky_unauthenticated_public") == 0
    assert stats(server, "s3cret")["unauthenticated_public"] is False
    assert admitted(server, auth_token="s3cret")
    assert not admitted(server)  # the token is asked for
    assert WARNING not in server.log()


def test_a_server_with_users_serves_beyond_loopback(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    users = tmp_path / "users.toml"
    users.write_text(f'[users.alice]\npassword = "{hash_password("wonderland")}"\n')
    server = start_server("--host", "0.0.0.0", "--users", str(users), workers=1)
    assert scrape(server, "broky_unauthenticated_public") == 0
    assert admitted(server, user="alice", password="wonderland")
    assert not admitted(server)
    assert WARNING not in server.log()


def test_mutual_tls_alone_is_not_a_credential(tmp_path: Path) -> None:
    """The https port asks for no client certificate: its /v1/ routes would be open."""
    done = subprocess.run(
        [sys.executable, "-m", "broky", "certs", str(tmp_path), "--client", "app"],
        capture_output=True,
        timeout=60,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr.decode()
    tls = ("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"))
    mutual = (*tls, "--tls-ca", str(tmp_path / "ca.pem"), "--tls-verify-clients")
    line = refused(serve("--host", "0.0.0.0", *mutual))
    assert "--tls-verify-clients guards the client port only" in line, line
    assert "--tls-verify-clients" not in refused(serve("--host", "0.0.0.0", *tls))


# ---------------------------------------------------------------- loopback: as before


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_serves_without_a_credential_as_before(
    host: str, start_server: Callable[..., ServerProcess]
) -> None:
    server = start_server("--host", host, workers=1)
    assert scrape(server, "broky_unauthenticated_public") == 0
    assert stats(server)["unauthenticated_public"] is False
    assert admitted(server)
    assert WARNING not in server.log() and " WARNING " not in server.log()


# ---------------------------------------------------------------- the image and the docs


def test_the_image_serves_on_0_0_0_0_with_the_opt_out_it_sets(
    start_server: Callable[..., ServerProcess],
) -> None:
    """The Dockerfile's ENTRYPOINT with its ENV, run here as the container runs them."""
    text = (ROOT / "Dockerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (.+)$", text, re.M)
    assert entry is not None
    command = json.loads(entry.group(1))
    assert command[:2] == ["broky", "serve"]
    env = dict(re.findall(r"\b(BROKY_\w+)=(\S+)", text.split("\nENV ", 1)[1].split("\n\n", 1)[0]))
    assert env == {"BROKY_ALLOW_UNAUTHENTICATED": "1"}
    server = start_server(*command[2:], workers=1, env=env)
    assert server.host == "0.0.0.0"
    server.wait_log(WARNING)
    assert scrape(server, "broky_unauthenticated_public") == 1
    refused([sys.executable, "-m", *command, *QUICK], clean_env(BROKY_ALLOW_UNAUTHENTICATED="no"))


def test_the_container_page_publishes_on_loopback_and_removes_its_container() -> None:
    page = (ROOT / "docs" / "operations" / "container.md").read_text().replace("\\\n", " ")
    runs = [
        re.split(r"[`\n]", page[m.start() :], maxsplit=1)[0]
        for m in re.finditer(r"(podman|docker) run\b", page)
    ]
    publishing = [run for run in runs if " -p " in run]
    assert len(publishing) >= 2, runs
    for run in publishing:
        assert "--rm" in run.split(), run
        published = re.findall(r" -p (\S+)", run)
        assert all(p.startswith("127.0.0.1:") for p in published), run


def docs_lines() -> list[str]:
    text = (ROOT / "docs" / "operations" / "production.md").read_text()
    mark = (
        "<!-- example: tested by tests/server/e2e/test_exposure.py::test_the_docs_lines_do_what_they_say -->"
    )
    block = text.split(mark, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_docs_lines_do_what_they_say(tmp_path: Path) -> None:
    """The production page's three lines, on free ports: refused, served with a token
    (made by the line's own openssl), served open with the warning."""
    bin_dir = str(Path(sys.executable).parent)
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    first, with_token, open_ = docs_lines()
    page = (ROOT / "docs" / "operations" / "production.md").read_text()
    said = re.search(
        r"The refusal is one line on stderr \(exit status 2\): `broky serve: error:\n(.+?)`", page, re.S
    )
    assert said is not None
    line = refused(["bash", "-c", f"{first} {shlex.join(QUICK)}"], env)
    assert line == " ".join(said.group(1).split())
    for command, warned in ((with_token, False), (open_, True)):
        server = ServerProcess(*QUICK)
        server.args = ["bash", "-c", f"{command} {shlex.join(QUICK)}"]
        server.env = env
        try:
            server.start()
            assert server.host == "0.0.0.0"
            assert scrape(server, "broky_unauthenticated_public") == (1 if warned else 0)
            if warned:
                server.wait_log(WARNING)
            else:
                assert WARNING not in server.log()
        finally:
            server.stop()
