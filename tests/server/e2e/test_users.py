"""Users and permissions against a real `broky serve --users` (broky.server.security.users)."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

import broky
from broky.errors import ErrorCode, ServerError
from broky.matching import parse_pattern
from broky.server.security import users as users_module
from broky.server.security.users import covers, hash_password, meets, verify_password
from tests.support.serverproc import ServerProcess
from tests.support.tls import client_context, tls_args, tls_url

FAST = 1000  # PBKDF2 iterations in tests (the default is slow on purpose)


def users_file(path: Path, alice_subscribe: list[str]) -> Path:
    path.write_text(
        f"""
[users.alice]
password = "{hash_password("apw", FAST)}"
publish = {{ allow = ["orders.>"], deny = ["orders.secret.>"] }}
subscribe = {{ allow = {json.dumps(alice_subscribe)}, deny = ["orders.secret.>"] }}
groups = false

[users.bob]
password = "{hash_password("bpw", FAST)}"

[users.client]
cert_subject = "CN=client"
password = "{hash_password("cpw", FAST)}"
publish = {{ allow = ["m.>"] }}
"""
    )
    return path


def denied(server: ServerProcess, user: str) -> float:
    with urllib.request.urlopen(_request(server, "/metrics", "bob", "bpw")) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("broky_permission_denied_total{") and f'user="{user}"' in line
    )


def _request(
    server: ServerProcess, path: str, user: str, password: str, data: bytes | None = None
) -> urllib.request.Request:
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.request.Request(
        f"http://127.0.0.1:{server.metrics_port}{path}",
        data=data,
        headers={"Authorization": f"Basic {basic}"},
    )


def test_patterns_and_the_constant_time_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    p = parse_pattern
    assert covers(p(b"orders.>"), p(b"orders.*.x")) and not covers(p(b"orders.*"), p(b"orders.>"))
    assert covers(p(b"*.a"), p(b"x.a")) and not covers(p(b"x.a"), p(b"*.a"))
    assert meets(p(b"orders.secret.>"), p(b"orders.>")) and meets(p(b"*.b"), p(b"a.*"))
    assert not meets(p(b"orders.secret.>"), p(b"orders.public.*")) and not meets(p(b"a"), p(b"a.b"))
    stored = hash_password("pw", FAST)
    assert stored.startswith(f"pbkdf2-sha256${FAST}$")
    compared: list[tuple[bytes, bytes]] = []
    import hmac

    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert verify_password(stored, "pw") and not verify_password(stored, "wrong")
    assert len(compared) == 2  # every check goes through hmac.compare_digest
    assert users_module.Users({"users": {}}).check("nobody:x") is None
    # broky passwd: the hash line of a password read from stdin
    made = subprocess.run(
        [sys.executable, "-m", "broky", "passwd"],
        input="s3cret\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert made.returncode == 0 and verify_password(made.stdout.strip(), "s3cret")


def test_allowed_denied_reload_and_the_http_gateway(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    path = users_file(tmp_path / "users.toml", ["orders.>"])
    server = start_server("--users", str(path))
    with pytest.raises(ServerError) as wrong:
        broky.connect_sync(server.url, user="alice", password="nope", connect_timeout=3)
    assert wrong.value.code == ErrorCode.AUTH_FAILED
    with pytest.raises(ServerError) as anonymous:
        broky.connect_sync(server.url, connect_timeout=3)
    assert anonymous.value.code == ErrorCode.AUTH_FAILED

    async def main() -> None:
        errors: list[BaseException] = []
        async with (
            broky.connect(server.url, user="alice", password="apw", on_error=errors.append) as alice,
            broky.connect(server.url, user="bob", password="bpw") as bob,
        ):
            watch = await bob.subscribe("orders.>")
            mine = await alice.subscribe("orders.*")  # (orders.> would meet the denied orders.secret.>)
            with pytest.raises(ServerError, match=r"PERMISSION|covered by no allowed") as sub_refused:
                await alice.subscribe("prices.x")
            assert sub_refused.value.code == ErrorCode.PERMISSION_DENIED
            with pytest.raises(ServerError, match=re.escape("denied pattern 'orders.secret.>'")):
                await alice.subscribe("orders.*.x")
            with pytest.raises(ServerError, match="groups"):
                await alice.subscribe("orders.g", group="g")
            await asyncio.sleep(0.1)
            assert errors == []  # each refusal raised by `subscribe`, once: not told again to on_error
            await alice.publish("orders.secret.a", b"no", partition="kp")  # refused: the connection stays
            await alice.publish("prices.a", b"no", partition="kp")
            await alice.publish("orders.a", b"yes", partition="kp")
            await alice.flush()
            assert (await watch.next_msg(5)).payload == b"yes"
            assert (await mine.next_msg(5)).payload == b"yes"
            for _ in range(50):
                if len(errors) >= 2:
                    break
                await asyncio.sleep(0.05)
            codes = [getattr(e, "code", None) for e in errors]
            assert codes.count(ErrorCode.PERMISSION_DENIED) == 2, errors
            assert alice.stats.denied == 2
            assert "orders.secret.>" in str(errors[0]) and "prices.a" in str(errors[1])
            assert denied(server, "alice") >= 5
            with urllib.request.urlopen(_request(server, "/connections", "bob", "bpw")) as r:
                listed = [c["user"] for c in json.loads(r.read())["connections"]]
            assert {"alice", "bob"} <= set(listed)
            # the HTTP gateway acts as the user of the request's Basic credentials
            with urllib.request.urlopen(
                _request(server, "/v1/pub/orders.h?lines=0", "alice", "apw", b"h")
            ) as r:
                assert json.loads(r.read())["published"] == 1
            assert (await watch.next_msg(5)).payload == (await mine.next_msg(5)).payload == b"h"
            for req, status in (
                (_request(server, "/v1/pub/orders.secret.h?lines=0", "alice", "apw", b"h"), 403),
                (_request(server, "/v1/pub/orders.h?lines=0", "alice", "bad", b"h"), 401),
                (urllib.request.Request(f"http://127.0.0.1:{server.metrics_port}/stats"), 401),
            ):
                with pytest.raises(urllib.error.HTTPError) as http:
                    urllib.request.urlopen(req)
                http.value.close()  # its socket: else a ResourceWarning in whatever test runs later
                assert http.value.code == status
            # the CLI: --user, the password from the environment (never a flag)
            env = {**os.environ, "BROKY_PASSWORD": "apw"}
            pub = [sys.executable, "-m", "broky", "pub", "--server", server.url, "--user", "alice"]
            done = await asyncio.to_thread(
                subprocess.run, [*pub, "orders.cli", "c"], env=env, capture_output=True, timeout=30
            )
            assert done.returncode == 0, done.stderr
            assert (await watch.next_msg(5)).payload == (await mine.next_msg(5)).payload == b"c"
            # SIGHUP: alice may subscribe to orders.eu.> only; her orders.* subscription ends
            errors.clear()
            stream = await asyncio.to_thread(
                urllib.request.urlopen, _request(server, "/v1/sub/orders.*?format=ndjson", "alice", "apw")
            )
            users_file(path, ["orders.eu.>"])
            server.signal(signal.SIGHUP)
            with stream:
                lines = await asyncio.to_thread(stream.read)  # to its end: the reload ends it, and says so
            assert b'"denied"' in lines and b"ended by a reload" in lines, lines
            for _ in range(100):
                if errors:
                    break
                await asyncio.sleep(0.05)
            await alice.flush()  # every worker ended it (one Error each): told once
            assert len(errors) == 1 and getattr(errors[0], "code", None) == ErrorCode.PERMISSION_DENIED, (
                errors
            )
            assert "ended by a reload" in str(errors[0])
            path.write_text("[users.alice\n")  # a file that does not read: the users in force stay
            server.signal(signal.SIGHUP)
            server.wait_log("users not reloaded")
            eu = await alice.subscribe("orders.eu.>")
            with pytest.raises(ServerError, match=r"PERMISSION|covered"):
                await alice.subscribe("orders.us")
            await bob.publish("orders.eu.1", b"eu", partition="kp")
            await bob.publish("orders.us", b"us", partition="kp")
            await bob.flush()
            assert (await eu.next_msg(5)).payload == b"eu"
            assert [(await watch.next_msg(5)).payload for _ in range(2)] == [b"eu", b"us"]
            with pytest.raises(TimeoutError):
                await mine.next_msg(0.3)  # ended: nothing more arrives there

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_cli_fails_on_a_refusal_and_says_it_once(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Issue 37: `broky pub` exited 0 after PERMISSION_DENIED (the refusal only a warning
    line), and a refused `broky sub` was printed three times (each worker's refusal, then
    the error)."""
    server = start_server("--users", str(users_file(tmp_path / "users.toml", ["orders.>"])))
    env = {**os.environ, "BROKY_PASSWORD": "apw"}
    cli = [sys.executable, "-m", "broky"]
    common = ["--server", server.url, "--user", "alice"]

    def broky_(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, *args, *common], input=stdin.decode(), env=env, capture_output=True, text=True, timeout=30
        )

    done = broky_("pub", "orders.secret.x", "no")
    assert done.returncode == 1, done
    assert done.stderr.splitlines() == [
        "broky pub: error: 1 of 1 message refused, not published: PERMISSION_DENIED: user 'alice': "
        "publish to 'orders.secret.x' refused: denied by the pattern 'orders.secret.>'"
    ], done.stderr
    done = broky_("pub", "prices.x", stdin=b"a\nb\nc\n")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done
    assert done.stderr.startswith("broky pub: error: 3 of 3 messages refused, not published: "), done.stderr
    assert "publish to 'prices.x' refused: matched by no allowed pattern ('orders.>')" in done.stderr
    done = broky_("pub", "orders.ok", "yes")
    assert done.returncode == 0 and done.stderr == "", done
    done = broky_("sub", "prices.>", "--count", "1")
    assert done.returncode == 1, done
    assert done.stderr.splitlines() == [
        "broky sub: error: PERMISSION_DENIED: user 'alice': subscription 1 to 'prices.>' refused: "
        "covered by no allowed pattern ('orders.>')"
    ], done.stderr


def test_a_client_certificate_subject_stands_for_the_user(
    start_server: Callable[..., ServerProcess],
    certs: Path,
    tmp_path: Path,
) -> None:
    path = users_file(tmp_path / "users.toml", ["orders.>"])
    server = start_server(
        *tls_args(certs, "--tls-ca", str(certs / "ca.pem"), "--tls-verify-clients"), "--users", str(path)
    )

    async def main() -> None:
        errors: list[BaseException] = []
        ctx = client_context(certs, cert="client")
        async with broky.connect(tls_url(server), ssl_context=ctx, on_error=errors.append) as client:
            sub = await client.subscribe("m.>")
            await client.publish("x.y", b"no", partition="kp")
            await client.publish("m.y", b"yes", partition="kp")
            await client.flush()
            assert (await sub.next_msg(5)).payload == b"yes"
            for _ in range(50):
                if errors:
                    break
                await asyncio.sleep(0.05)
            assert [getattr(e, "code", None) for e in errors] == [ErrorCode.PERMISSION_DENIED]
            # the gateway reaches its workers over TLS with the server's own token
            basic = base64.b64encode(b"bob:bpw").decode()
            # http.client, closed here: urllib leaves its TLS socket to the garbage collector,
            # whose ResourceWarning then fails whichever test is running
            https = http.client.HTTPSConnection(
                "127.0.0.1", server.metrics_port, context=client_context(certs), timeout=10
            )
            try:
                https.request("POST", "/v1/pub/m.gw?lines=0", b"gw", {"Authorization": f"Basic {basic}"})
                answer = https.getresponse()
                assert answer.status == 200 and json.loads(answer.read())["published"] == 1
            finally:
                https.close()
            assert (await sub.next_msg(5)).payload == b"gw"

    asyncio.run(asyncio.wait_for(main(), 60))
    # A token sent beside the certificate must be right, and name its user (issue 37: a
    # wrong password was overridden by the certificate without a word).
    ctx = client_context(certs, cert="client")
    url = tls_url(server)
    for user, password in (("client", "wrong"), ("nobody", "x"), ("bob", "bpw")):  # bob's is right
        with pytest.raises(ServerError) as refused:
            broky.connect_sync(url, ssl_context=ctx, user=user, password=password, connect_timeout=5)
        assert refused.value.code == ErrorCode.AUTH_FAILED, (user, refused.value)
    with broky.connect_sync(url, ssl_context=ctx, user="client", password="cpw", connect_timeout=5) as client:
        client.publish("m.ok", b"ok", partition="kp")
        client.flush()
        assert client.stats.denied == 0


def test_a_resume_counts_publishes_refused_for_permissions_in_refused(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    # schema/README.md 3, 7.1: Welcome.resumed.refused counts the processed publishes refused
    # with PERMISSION_DENIED as it counts NOT_MY_VBUCKET's: an Error carried each back.
    from broky.protocol import Error, PreviousConnection, Resumed
    from tests.support.wire import Wire, kp_for_worker

    server = start_server("--users", str(users_file(tmp_path / "users.toml", ["orders.>"])), workers=2)
    mine, theirs = kp_for_worker(0, 2), kp_for_worker(1, 2)
    with Wire.hello(server.address, worker=0, token="alice:apw") as first:
        first.publish(mine, b"orders.secret.a")  # denied
        first.publish(theirs, b"orders.a")  # worker 1's
        first.publish(mine, b"orders.a")  # served
        errors = first.flush()
        assert [(e.code, e.fatal) for e in errors if isinstance(e, Error)] == [
            (ErrorCode.PERMISSION_DENIED, False),
            (ErrorCode.NOT_MY_VBUCKET, False),
        ]
        welcome = first.welcome
    assert welcome is not None
    prev = PreviousConnection(welcome.connection_id, 0, 0, welcome.resume_token)
    with Wire.hello(server.address, worker=0, token="alice:apw", previous=prev) as again:
        assert again.welcome is not None
        assert again.welcome.resumed == Resumed(welcome.connection_id, 3, 2)
