"""examples/cluster/: run.py starts etcd and three nodes with one command; the
docker-compose.yml is checked for what can be checked without starting containers
(its settings parse as `broky serve` settings, its etcd flags are the flags of
Debian's etcd that its etcd image runs, its Prometheus configuration passes promtool,
its images are the ones `scripts/build-image --cluster` builds). Running it with
podman-compose takes half a minute: it was run by hand (docs/operations/container.md,
"A cluster in containers"); tests/repo/test_image.py builds and runs Broky's image."""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import broky
from broky.server import config
from tests.support import requires
from tests.support.paths import ROOT

EXAMPLE = ROOT / "examples" / "cluster"
READY = re.compile(r"cluster ready: 3 nodes, map version \d+, leader node\d, seeds (\S+)")
SHARES = re.compile(r"  vbuckets per node: node1 (\d+), node2 (\d+), node3 (\d+)$")
PID = re.compile(r"pid (\d+)")
WORKDIR = re.compile(r"data and logs (?:kept )?in (\S+?)\)?$")
QUICK_START = (4777, 9477)  # what `./run serve` holds while the docs' reader tries the example


@pytest.fixture
def quick_start_ports() -> Iterator[None]:
    """4777 and 9477 held, as by a `./run serve` (by this test, or already by something else)."""
    held = []
    for port in QUICK_START:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError as exc:
            s.close()
            assert exc.errno == errno.EADDRINUSE, exc  # held by another process: as good
            continue
        held.append(s)
    yield
    for s in held:
        s.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def read_until_ready(proc: subprocess.Popen[bytes], timeout: float) -> list[str]:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    lines: list[str] = []
    pending = b""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        pending += chunk
        *done, pending = pending.split(b"\n")
        lines += [line.decode() for line in done]
        if any(READY.search(line) for line in lines):
            return lines
    raise AssertionError(f"run.py not ready within {timeout:g} s:\n" + "\n".join(lines))


async def round_trip(seeds: str, partitions: int) -> dict[bytes, list[bytes]]:
    """Subscribe through the last seed, publish through the first; what arrived, per partition."""
    got: dict[bytes, list[bytes]] = {}
    last_seed, first_seed = seeds.split(",")[-1], seeds.split(",")[0]
    async with broky.connect(last_seed) as sub, broky.connect(first_seed) as pub:
        done = asyncio.Event()
        count = 0

        async def on_message(m: broky.Message) -> None:
            nonlocal count
            got.setdefault(m.key_partition, []).append(m.payload)
            count += 1
            if count == partitions * 3:
                done.set()

        await sub.subscribe("demo.>", callback=on_message)
        for i in range(3):
            for p in range(partitions):
                await pub.publish(b"demo.k", b"%d" % i, partition=b"tenant-%d" % p)
        await pub.flush()  # raises if any publish may have been lost
        await asyncio.wait_for(done.wait(), 20)
    return got


def test_run_py_starts_a_cluster_clients_use_and_stops_every_process(quick_start_ports: None) -> None:
    requires.program("etcd")
    proc = subprocess.Popen(  # on its default ports: free ones, beside the Quick start's server
        [sys.executable, str(EXAMPLE / "run.py"), "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        lines = read_until_ready(proc, 90)
        pids = [int(m.group(1)) for line in lines if (m := PID.search(line))]
        assert len(pids) == 4, lines  # etcd and three nodes
        seeds = next(m.group(1) for line in lines if (m := READY.search(line)))
        assert not {f"127.0.0.1:{port}" for port in QUICK_START} & set(seeds.split(","))
        # the map it prints is the settled one: 1024 vbuckets over the three nodes' workers
        shares = next([int(n) for n in m.groups()] for line in lines if (m := SHARES.search(line)))
        assert sorted(shares) == [341, 341, 342], lines
        workdir = Path(next(m.group(1) for line in lines if (m := WORKDIR.search(line))))
        assert (workdir / "node1.log").exists()
        got = asyncio.run(round_trip(seeds, 50))
        assert got == {b"tenant-%d" % p: [b"0", b"1", b"2"] for p in range(50)}
        # `broky info` on node1: the whole map, and what node1 sees of the cluster
        http = next(m.group(1) for line in lines if (m := re.match(r"node1: .*, HTTP (\S+), pid", line)))
        info = subprocess.run(
            [sys.executable, "-m", "broky", "info", "--server", seeds.split(",")[0], "--metrics", http,
             "--interval", "0.2"],
            capture_output=True, timeout=30,
        )  # fmt: skip
        assert info.returncode == 0, info.stderr
        text = info.stdout.decode()
        assert re.search(r"^map       version \d+, 1024 vbuckets, 3 node\(s\)$", text, re.MULTILINE), text
        assert re.search(
            r"^cluster   node node1, leader node\d, 3 members, map version \d+$", text, re.MULTILINE
        )
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C (SIGTERM alike): each node drains into those left
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out.decode()
        assert out.decode().splitlines()[-1] == "stopped"
        assert "Traceback" not in out.decode()
        assert not [pid for pid in pids if alive(pid)]
        assert not workdir.exists()
        print(f"run.py stopped three nodes and etcd in {time.monotonic() - started:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_run_py_on_a_port_taken_names_it_and_keeps_the_log_it_points_to() -> None:
    requires.program("etcd")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, str(EXAMPLE / "run.py"), "--nodes", "1", "--workers", "1", "--port", str(port)],
            capture_output=True,
            timeout=90,
            start_new_session=True,
        )
    out, err = done.stdout.decode(), done.stderr.decode()
    workdir = Path(next(m.group(1) for line in out.splitlines() if (m := WORKDIR.search(line))))
    try:
        assert done.returncode == 1, out + err
        assert out.splitlines()[-1] == f"stopped; data and logs kept in {workdir}"
        failure, see, hint = err.splitlines()
        assert failure.startswith("run.py: node1 did not start: ")
        assert f"cannot listen on 127.0.0.1:{port} for clients: address already in use" in failure
        assert "choose another port with --port PORT" in failure
        assert see == f"run.py: see {workdir}/node1.log"
        assert (
            failure.split(": ", 2)[2] in (workdir / "node1.log").read_text()
        )  # quoted from the log it keeps
        assert hint == "run.py: without --port, --metrics-port and --etcd-port it picks free ports"
        pids = [int(m.group(1)) for line in out.splitlines() if (m := PID.search(line))]
        assert pids and not [pid for pid in pids if alive(pid)]  # etcd stopped all the same
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def compose_nodes(text: str) -> dict[str, dict[str, str]]:
    """Each node service's environment, with the shared `x-cluster` anchor merged in.

    A reader of this one file's plain layout (no YAML library in the project):
    `name:` at two spaces starts a service, `KEY: value` at six spaces is an
    environment entry, `<<: *cluster` merges the anchor's entries."""
    anchor: dict[str, str] = {}
    nodes: dict[str, dict[str, str]] = {}
    section = ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            section = line.split(":")[0]
            continue
        entry = re.fullmatch(r"( +)([A-Za-z0-9_<]+): *(.*)", line)
        if entry is None:
            continue
        indent, key, value = len(entry.group(1)), entry.group(2), entry.group(3).strip().strip('"')
        if section == "x-cluster" and indent == 2:
            anchor[key] = value
        elif section == "services" and indent == 2:
            service = key
        elif section == "services" and indent == 6 and service.startswith("node"):
            env = nodes.setdefault(service, {})
            env.update(anchor if (key, value) == ("<<", "*cluster") else {key: value})
    return nodes


def test_docker_compose_nodes_are_valid_broky_serve_settings() -> None:
    nodes = compose_nodes((EXAMPLE / "docker-compose.yml").read_text())
    assert sorted(nodes) == ["node1", "node2", "node3"]
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    seen = set()
    for name, env in nodes.items():
        # ${BROKY_ADVERTISE_HOST:-127.0.0.1} is compose's interpolation, with its default
        env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
        assert all(k.startswith("BROKY_") for k in env), env
        cfg = config.from_args(parser.parse_args([]), env, warn=pytest.fail)
        assert cfg.cluster == "etcd://etcd:2379/broky"
        assert (cfg.node_id, cfg.workers, cfg.advertised_host()) == (name, 2, "127.0.0.1")
        seen.add((cfg.port, cfg.metrics_port))
        assert f'"127.0.0.1:{cfg.port}:{cfg.port}"' in (EXAMPLE / "docker-compose.yml").read_text()
    assert len(seen) == 3  # one pair of published ports per node
    prometheus = (EXAMPLE / "prometheus.yml").read_text()
    for name, env in nodes.items():
        assert f"{name}:{env['BROKY_METRICS_PORT']}" in prometheus


def test_docker_compose_runs_the_images_build_image_builds_and_etcds_own_flags() -> None:
    text = (EXAMPLE / "docker-compose.yml").read_text()
    script = (EXAMPLE.parent.parent / "scripts" / "build-image").read_text()
    images = re.findall(r"^ +image: (\S+)$", text, re.M)
    assert set(images) == {f"localhost/broky{s}:latest" for s in ("", "-etcd", "-prometheus")}
    for name in ("etcd", "prometheus"):
        assert f"dockerfile: {name}.Dockerfile" in text and (EXAMPLE / f"{name}.Dockerfile").is_file()
        assert f"build localhost/broky-{name} examples/cluster examples/cluster/{name}.Dockerfile" in script
    # The etcd image runs Debian's etcd-server, the package the tests' etcd comes from.
    flags = re.findall(r"^      - (--[a-z-]+)=", text[text.index("  etcd:\n") :], re.M)
    assert len(flags) == 7, flags
    help_text = subprocess.run(
        [requires.program("etcd"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert [f for f in flags if f"{f} " not in help_text.stdout + help_text.stderr] == []


def test_the_example_prometheus_configuration_is_valid() -> None:
    promtool = requires.program("promtool")
    done = subprocess.run(
        [promtool, "check", "config", str(EXAMPLE / "prometheus.yml")], capture_output=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
