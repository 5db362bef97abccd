"""The manual's examples run as written, and its tables say what the code does.

Every fenced block of every page under docs/ and of the README is checked as
docs/contributing/development.md ("Examples are run") says: a `python` block
is a whole program run against a real `broky serve` on free ports (its
addresses rewritten to that server's), a `sh` block runs line by line,
`json`, `toml` and `yaml` blocks parse, and a comment on the line before a
block can say it runs until stopped, is run by another test (which must
exist), or is not run (then it is still compiled, or parsed by `bash -n`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import requires
from tests.support.serverproc import ServerProcess

ROOT = next(
    p for p in Path(__file__).resolve().parents if (p / "mkdocs.yml").exists()
)  # wherever tests/ puts this
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
LANGUAGES = {"python", "sh", "json", "toml", "yaml", "text", "js"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!-- example: (?P<mark>.+?) -->")
UNTIL_STOPPED = re.compile(r"runs until stopped, (\d+) lines?")
TESTED_BY = re.compile(r"tested by (tests/[\w/]+\.py)::(\w+)")
PRINTS = re.compile(r"prints: (.+)")
RUN_TIMEOUT = 60.0


@dataclass(frozen=True)
class Example:
    page: str  # its path from the repository's root
    line: int  # of its opening fence
    lang: str
    code: str
    mark: str  # the comment's text after "example: ", or ""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            indent = len(fence.group("indent"))
            code = "".join(line[indent:] for line in fence.group("body").splitlines(keepends=True))
            before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            mark = MARK.fullmatch(before)
            found.append(
                Example(
                    page=page.relative_to(ROOT).as_posix(),
                    line=text.count("\n", 0, fence.start()) + 1,
                    lang=fence.group("lang"),
                    code=code,
                    mark=mark.group("mark") if mark else "",
                )
            )
    return found


EXAMPLES = examples()


def needs_spark(example: Example) -> bool:
    return "pyspark" in example.code


def run_here(example: Example) -> bool:
    """Whether this module runs it against a server of its own (else: parsed, or another test's)."""
    mark = example.mark
    return example.lang in ("python", "sh") and (
        not mark or bool(UNTIL_STOPPED.fullmatch(mark) or PRINTS.fullmatch(mark))
    )


def rewritten(code: str, server: ServerProcess) -> str:
    """`code` with the documented addresses replaced by those of `server`."""
    for host in ("127.0.0.1", "localhost"):
        code = code.replace(f"{host}:4777", f"{server.host}:{server.port}")
        code = code.replace(f"{host}:9477", f"{server.host}:{server.metrics_port}")
    return code


def environment(server: ServerProcess, tmp_path: Path) -> dict[str, str]:
    """What the examples' processes run with: the server as the default one, the venv's
    programs first on PATH (as `source .venv/bin/activate` puts them: a stand-in in
    tmp_path does, for examples that say so)."""
    bin_dir = str(Path(sys.executable).parent)
    activate = tmp_path / ".venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True, exist_ok=True)
    activate.write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "BROKY_SERVER": f"{server.host}:{server.port}",
        "BROKY_METRICS": f"{server.host}:{server.metrics_port}",
    }


def read_lines(proc: subprocess.Popen[bytes], count: int, timeout: float) -> list[str]:
    """Up to `count` lines of `proc`'s stdout, waiting at most `timeout` seconds."""
    assert proc.stdout is not None
    fd, pending = proc.stdout.fileno(), b""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while len(lines) < count and (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        *done, pending = pending.split(b"\n")
        lines += [line.decode() for line in done]
    return lines[:count]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop `proc` and whatever it started (its own session), by its pid."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def metric_sum(server: ServerProcess, name: str) -> float:
    url = f"http://{server.host}:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if re.match(rf"{name}(\{{| )", line))


# ---------------------------------------------------------------- every block, parsed


def test_every_block_names_its_language_and_says_how_it_is_checked() -> None:
    assert len(EXAMPLES) > 40, "the pages have their examples"
    for example in EXAMPLES:
        assert example.lang in LANGUAGES, f"{example}: a block names its language ({sorted(LANGUAGES)})"
        mark = example.mark
        if not mark:
            continue
        tested = TESTED_BY.fullmatch(mark)
        if tested:
            path, name = tested.groups()
            assert (ROOT / path).exists(), f"{example}: {path} is not there"
            assert f"def {name}(" in (ROOT / path).read_text(), f"{example}: {path} has no {name}"
        else:
            known = (
                UNTIL_STOPPED.fullmatch(mark)
                or PRINTS.fullmatch(mark)
                or re.fullmatch(r"not run: \S.*", mark)
            )
            assert known, f"{example}: {mark}"


def test_the_blocks_of_data_parse() -> None:
    parsers: dict[str, Callable[[str], object]] = {
        "json": json.loads,
        "toml": tomllib.loads,
        "yaml": yaml.safe_load,
    }
    checked = 0
    for example in EXAMPLES:
        if example.lang in parsers:
            try:
                parsers[example.lang](example.code)
            except Exception as exc:
                pytest.fail(f"{example}: {exc}")
            checked += 1
    assert checked >= 5


def test_the_examples_not_run_here_compile() -> None:
    for example in EXAMPLES:
        if example.lang == "python":
            compile(example.code, str(example), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        elif example.lang == "sh":
            done = subprocess.run(
                ["bash", "-n"], input=example.code.encode(), capture_output=True, timeout=30
            )
            assert done.returncode == 0, f"{example}: {done.stderr.decode()}"


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav: Any) -> Iterator[str]:
        if isinstance(nav, str):
            yield nav
        elif isinstance(nav, list):
            for item in nav:
                yield from pages(item)
        elif isinstance(nav, dict):
            for item in nav.values():
                yield from pages(item)

    listed = set(pages(config["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk <= listed, sorted(on_disk - listed)
    beside = listed - on_disk
    assert all((ROOT / path).exists() for path in beside), sorted(beside)


def test_links_between_docs_and_the_files_beside_the_code_are_pointed_at_the_site() -> None:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = "[p](../schema/README.md#51-x) [i](../bench/results/sdk_cpu.png) [s](sdk/index.md) [n](../run)"
    assert hooks.rewrite_links(page, DOCS / "http.md", "http.md") == (
        "[p](schema/README.md#51-x) [i](bench/results/sdk_cpu.png) [s](sdk/index.md) [n](../run)"
    )
    back = "[m](../docs/operations/monitoring.md) [f](broky.fbs) [u](https://example.org/a.md)"
    assert hooks.rewrite_links(back, ROOT / "schema" / "HTTP.md", "schema/HTTP.md") == (
        "[m](../operations/monitoring.md) [f](broky.fbs) [u](https://example.org/a.md)"
    )


# ---------------------------------------------------------------- the examples, run


def ids(examples: list[Example]) -> list[Any]:
    return [pytest.param(e, id=str(e), marks=[pytest.mark.spark] if needs_spark(e) else []) for e in examples]


PROGRAMS = [e for e in EXAMPLES if run_here(e) and e.lang == "python" and not needs_spark(e)]
SPARK_PROGRAMS = [  # run here as scripts, those another test runs too (that one in its Spark session)
    e for e in EXAMPLES if e.lang == "python" and needs_spark(e) and not e.mark.startswith("not run:")
]
SHELL = [e for e in EXAMPLES if run_here(e) and e.lang == "sh"]


@pytest.mark.parametrize("example", ids(PROGRAMS))
def test_a_program_runs_as_written(
    example: Example, start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    server = start_server()
    code = rewritten(example.code, server)
    until = UNTIL_STOPPED.fullmatch(example.mark)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=environment(server, tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        if until:
            count = int(until.group(1))
            lines = read_lines(proc, count, RUN_TIMEOUT)
            assert proc.poll() is None, f"{example} ended: {proc.communicate()[1].decode()}"
            assert len(lines) == count, f"{example} printed {lines}"
        else:
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
            assert proc.returncode == 0, f"{example}:\n{err.decode()}"
            assert out.strip(), f"{example} printed nothing"
            prints = PRINTS.fullmatch(example.mark)
            if prints:
                assert out.decode().splitlines()[0] == prints.group(1), f"{example} printed {out.decode()}"
    finally:
        stop(proc)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example", ids(SPARK_PROGRAMS))
def test_a_spark_program_runs_as_written(example: Example, server: ServerProcess, tmp_path: Path) -> None:
    """As a user runs it: a script, `.venv/bin/python app.py`, in a directory of its own, neither
    the venv activated nor PYSPARK_PYTHON set, so that Spark's Python workers would start the
    `python3` of PATH (here a stand-in without broky, as a system's is)."""
    (tmp_path / "app.py").write_text(rewritten(example.code, server))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text("#!/bin/sh\necho \"$0: No module named 'broky'\" >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)
    path = [str(bin_dir), *(d for d in os.environ.get("PATH", "").split(os.pathsep) if d != venv_bin)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_") and k != "VIRTUAL_ENV"}
    proc = subprocess.Popen(
        [sys.executable, "app.py"],
        cwd=tmp_path,
        env={**env, "PATH": os.pathsep.join(path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its JVM and Spark's Python workers share its group
    )
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what it started and left behind, if any
            os.killpg(proc.pid, signal.SIGKILL)
        stop(proc)
    assert proc.returncode == 0, f"{example}:\n{err.decode()[-3000:]}"
    assert out.strip(), f"{example} printed nothing"


@pytest.mark.parametrize("example", ids(SHELL))
def test_a_shell_example_runs_as_written(
    example: Example, start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    for name in sorted(requires.PACKAGES):  # the programs the tests need that a line calls
        if re.search(rf"(^|[|;&]\s*){name}\s", example.code, re.M):
            requires.program(name)
    server = start_server()
    env = environment(server, tmp_path)
    for line in rewritten(example.code, server).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        done = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, timeout=RUN_TIMEOUT
        )
        assert done.returncode == 0, f"{example}: {line}\n{done.stderr.decode()}"


def quick_start(page: str) -> Example:
    (example,) = [
        e
        for e in EXAMPLES
        if e.page == page and e.mark.endswith("::test_the_quick_start_prints_what_it_says")
    ]
    return example


@pytest.mark.timeout(90)
def test_the_quick_start_prints_what_it_says(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Three terminals: `./run serve` (the server this test starts), a `broky sub`, then
    the publishes; the subscriber prints what the page says it prints."""
    example = quick_start("docs/getting-started.md")
    assert quick_start("README.md").code == example.code, "the README's quick start is the docs'"
    terminals = [block.strip() for block in example.code.split("\n\n")]
    assert len(terminals) == 3 and terminals[0].startswith("./run serve "), terminals
    server = start_server()
    env = environment(server, tmp_path)
    sub = subprocess.Popen(
        ["bash", "-c", rewritten(terminals[1], server)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while metric_sum(server, "broky_subscriptions") < server.workers:  # on every worker
            assert sub.poll() is None and time.monotonic() < deadline, "broky sub did not subscribe"
            time.sleep(0.05)
        publish = rewritten(terminals[2], server)
        done = subprocess.run(["bash", "-c", publish], cwd=tmp_path, env=env, capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()
        said = (DOCS / "getting-started.md").read_text().split("Terminal 2 prints ", 1)[1].split(".", 1)[0]
        shown = re.findall(r"`([^`]+)`", said)
        assert read_lines(sub, len(shown), 30) == shown
    finally:
        stop(sub)


def examples_run_by(name: str) -> list[Example]:
    """The examples whose comment says this module's test `name` runs them, in page order."""
    return [e for e in EXAMPLES if e.mark == f"tested by tests/repo/test_docs_examples.py::{name}"]


def commands(example: Example) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines left out."""
    lines = example.code.replace("\\\n", " ").splitlines()
    return [line.split("  #", 1)[0].strip() for line in lines if line.strip() and not line.startswith("#")]


def serve_args(command: str, tmp_path: Path) -> list[str]:
    """The options of a documented `broky serve` command line, its files found in tmp_path."""
    words = shlex.split(command)
    assert words[:2] == ["broky", "serve"], command
    return [str(tmp_path / w) if (tmp_path / w).exists() else w for w in words[2:]]


def run_line(line: str, tmp_path: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, timeout=RUN_TIMEOUT
    )
    assert done.returncode == 0, f"{line}\n{done.stderr.decode()}"
    return done.stdout.decode()


def run_program(example: Example, server: ServerProcess, tmp_path: Path, env: dict[str, str]) -> str:
    """Run a documented program against `server`, the host name it names (a TLS
    certificate's) being `localhost`, whose certificate tmp_path's CA signed."""
    code = rewritten(example.code, server).replace("broky.example.com:4777", f"localhost:{server.port}")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, timeout=RUN_TIMEOUT
    )
    assert done.returncode == 0, f"{example}:\n{done.stderr.decode()}"
    assert done.stdout.strip(), f"{example} printed nothing"
    return done.stdout.decode()


def openssl(tmp_path: Path, *args: str) -> None:
    subprocess.run(
        [requires.program("openssl"), *args], cwd=tmp_path, check=True, capture_output=True, timeout=60
    )


def make_certificates(tmp_path: Path) -> None:
    """What the TLS examples name: ca.pem signed server.pem (for localhost),
    clients-ca.pem signed client.pem (CN=reporting)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for name, ca, cn, ext in (
        ("server", "ca", "localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "clients-ca", "reporting", "extendedKeyUsage=clientAuth"),
    ):
        if not (tmp_path / f"{ca}.pem").exists():
            openssl(tmp_path, "req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                    "-days", "2", "-subj", f"/CN={ca}")  # fmt: skip
        (tmp_path / f"{name}.ext").write_text(ext + "\n")
        openssl(tmp_path, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        openssl(tmp_path, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")  # fmt: skip


PASSWORD = "correct-horse-battery"  # as the page's curl line takes it: no space


def write_users(tmp_path: Path, env: dict[str, str]) -> str:
    """users.toml as the page shows it, every password hash that of PASSWORD made by the
    page's own `broky passwd < password.txt`; returns the remaining commands of its block."""
    (toml,) = [e for e in EXAMPLES if e.page == "docs/operations/production.md" and e.lang == "toml"]
    shell = next(e for e in examples_run_by("test_the_users_examples_run_as_written") if e.lang == "sh")
    passwd, *rest = commands(shell)
    (tmp_path / "password.txt").write_text(PASSWORD + "\n")
    digest = run_line(passwd, tmp_path, env).strip()
    assert digest.startswith("pbkdf2-sha256$"), digest
    (tmp_path / "users.toml").write_text(re.sub(r'password = "[^"]*"', f'password = "{digest}"', toml.code))
    return "\n".join(rest)


@pytest.mark.timeout(120)
def test_the_tls_examples_run_as_written(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    make_certificates(tmp_path)
    shell, program = examples_run_by("test_the_tls_examples_run_as_written")
    tls_only, mutual, reload = commands(shell)
    assert reload.startswith("kill -HUP MASTER_PID")
    for line in (tls_only, mutual):
        server = start_server(*serve_args(line, tmp_path))
        env = environment(server, tmp_path)
        if line == mutual:  # the program presents client.pem, which only mutual TLS asks for
            assert "published over TLS" in run_program(program, server, tmp_path, env)
        run_line(reload.replace("MASTER_PID", str(server.pid)), tmp_path, env)
        server.wait_log("SIGHUP received: TLS certificates reloaded")
        assert server.proc is not None and server.proc.poll() is None


@pytest.mark.timeout(120)
def test_the_users_examples_run_as_written(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    make_certificates(tmp_path)
    rest = write_users(tmp_path, dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    serve, reload, sub, curl = rest.splitlines()
    server = start_server(*serve_args(serve, tmp_path))
    env = environment(server, tmp_path)
    run_line(reload.replace("MASTER_PID", str(server.pid)), tmp_path, env)
    server.wait_log("SIGHUP received: 3 users reloaded")
    assert sub.startswith("BROKY_PASSWORD=... ")
    subscriber = subprocess.Popen(
        ["bash", "-c", sub.replace("BROKY_PASSWORD=...", f"BROKY_PASSWORD='{PASSWORD}'")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while metric_sum(server, "broky_subscriptions") < server.workers:
            assert subscriber.poll() is None and time.monotonic() < deadline, "broky sub did not subscribe"
            time.sleep(0.05)
        answer = run_line(rewritten(curl.replace("PASSWORD", PASSWORD), server), tmp_path, env)
        assert json.loads(answer).get("published") == 1, answer
        assert read_lines(subscriber, 1, 30) == ["hi"]
    finally:
        stop(subscriber)
    (program,) = [e for e in examples_run_by("test_the_users_examples_run_as_written") if e.lang == "python"]
    tls_only = commands(examples_run_by("test_the_tls_examples_run_as_written")[0])[0]
    over_tls = start_server(*serve_args(tls_only, tmp_path), *serve_args(serve, tmp_path))
    env = {**environment(over_tls, tmp_path), "BROKY_PASSWORD": PASSWORD}
    assert "published as orders-service" in run_program(program, over_tls, tmp_path, env)


QUICK_START_PAGES = ("docs/getting-started.md", "README.md")
STOP_FIRST = "stop the quick start's server first"


def takes_the_default_ports(command: str) -> bool:
    """Whether a command binds 4777 or 9477 on this machine, as the quick start's server does."""
    if re.search(r":(4777|9477):", command):  # a container's published port
        return True
    if not re.search(r"(^|[\s;&|(])(broky serve|\./run serve)\b", command):
        return False
    ports: dict[str, str] = dict(re.findall(r"--(port|metrics-port)[ =](\d+)", command))
    return ports.get("port", "4777") == "4777" or ports.get("metrics-port", "9477") == "9477"


def test_a_section_on_the_quick_starts_ports_says_to_stop_its_server_first() -> None:
    """A reader who follows the quick start has a server on 4777 and 9477: a later page's server
    either takes other ports or says, before it, to stop that one."""
    clashing = [
        e
        for e in EXAMPLES
        if e.lang == "sh"
        and e.page not in QUICK_START_PAGES
        and any(map(takes_the_default_ports, commands(e)))
    ]
    assert {e.page for e in clashing} >= {"docs/operations/production.md", "docs/operations/container.md"}
    for example in clashing:
        before = "\n".join((ROOT / example.page).read_text().splitlines()[: example.line])
        assert STOP_FIRST in " ".join(before.split()), f"{example}: takes 4777/9477 and does not say so"


def test_an_etcd_of_the_docs_keeps_its_data_in_a_temporary_directory_it_removes() -> None:
    blocks = [e for e in EXAMPLES if e.lang == "sh" and re.search(r"^etcd\s", e.code, re.M)]
    assert blocks
    for example in blocks:
        for line in re.findall(r"^etcd\s.*", example.code, re.M):
            found = re.search(r'--data-dir "\$(\w+)"', line)
            assert found, f"{example}: {line}"
            name = found.group(1)
            assert f"{name}=$(mktemp -d)" in example.code, f"{example}: ${name} is not a temporary directory"
            assert re.search(rf'rm -rf "\${name}"', example.code), f"{example}: ${name} is left behind"


# ---------------------------------------------------------------- tables that name the code


def table(page: str, heading: str, first: str) -> list[list[str]]:
    """The cells of the table whose header starts with `first` in `page`'s section `heading`."""
    text = (ROOT / page).read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    lines = section.split(f"| {first} |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_the_serve_options_table_names_every_option_of_broky_serve() -> None:
    import argparse

    from broky import cli

    parser = cli.build_parser("serve")
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = {o for a in commands.choices["serve"]._actions for o in a.option_strings if o.startswith("--")}
    options.discard("--help")
    rows = table("docs/cli.md", "## broky serve", "option")
    named = {o for row in rows for o in re.findall(r"`(--[\w-]+)`", row[0])}
    assert named == options


def test_the_counters_table_names_every_counter_of_client_stats() -> None:
    from broky.client.stats import ClientStats

    rows = table("docs/sdk/asyncio.md", "## The client's counters", "counter")
    named = [c for row in rows for c in re.findall(r"`(\w+)`", row[0])]
    assert sorted(named) == sorted(f.name for f in fields(ClientStats))


def test_the_options_table_names_every_option_of_connect() -> None:
    import inspect

    from broky.client.client import Client

    rows = table("docs/sdk/options.md", "## Options of `connect` / `connect_sync`", "option")
    named = {o for row in rows for o in re.findall(r"`(\w+)", row[0])}
    assert named == set(inspect.signature(Client.__init__).parameters) - {"self", "server"}


def test_the_layout_page_draws_the_import_rule_the_architecture_test_holds() -> None:
    (source,) = ROOT.glob("tests/**/test_architecture.py")
    values = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id in ("ALLOWED", "EXCEPTIONS"):
                assert node.value is not None
                values[target.id] = node.value
    allowed = {}
    for key, value in zip(values["ALLOWED"].keys, values["ALLOWED"].values, strict=True):  # type: ignore[attr-defined]
        name = "the shared modules" if isinstance(key, ast.Name) else ast.literal_eval(key)
        allowed[name] = set() if isinstance(value, ast.Call) else set(ast.literal_eval(value))  # set(): none
    exceptions = ast.literal_eval(values["EXCEPTIONS"])
    rows = table("docs/contributing/layout.md", "### Who may import whom", "package")
    drawn = {row[0].strip("`"): set(re.findall(r"`([\w.]+)`", row[1])) for row in rows}
    assert drawn == allowed
    rows = table("docs/contributing/layout.md", "### Who may import whom", "module")
    assert {(row[0].strip("`"), row[1].strip("`")) for row in rows} == exceptions


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    linked = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    assert "docs/index.md" in linked and all((ROOT / path).exists() for path in linked), linked
