"""The HTTP side as a browser uses it: headless Chromium's own EventSource and fetch against a
real `broky serve` (tests/support/browser.py drives it over the DevTools protocol).

An event stream must keep going whatever happens to its connection, as docs/http.md says
("reconnects by itself"), and end with every message or a told loss: resumed twice with
the same Last-Event-ID (a reconnect that died before its first event), across a server
restart (its HTTP port answers before its workers are ready), and while the server's
HTTP connections are full (a browser's EventSource gives up for good on any status but
200). And a page of another origin must not publish with the visitor's `broky_token`
cookie, nor read a stream, unless the server allows that origin.

The event streams are read by a page of the server itself (its /healthz), through a
FaultProxy where a test cuts the browser's connections. The pages of other origins come
from `Site`, a tiny server (127.0.0.1 and localhost on its port are two origins, and two
sites); the server lets one in with --http-allow-origin.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import broky
from tests.support.browser import Chromium, Page, Site
from tests.support.faultproxy import FaultProxy
from tests.support.serverproc import ServerProcess

TOKEN = "browser-t0ken"
PARTITIONS = [f"p{i}" for i in range(8)]

# The page's view of one EventSource: every payload, loss, `unavailable` event, open and error.
TRACK = """
window.track = (url) => {
  const t = {payloads: [], losses: [], unavailable: 0, opens: 0, errors: 0, closed: false};
  const es = new EventSource(url);
  es.onopen = () => { t.opens += 1; };
  es.onmessage = (e) => { t.payloads.push(JSON.parse(e.data).payload); };
  es.addEventListener("loss", (e) => { t.losses.push(JSON.parse(e.data)); });
  es.addEventListener("unavailable", () => { t.unavailable += 1; });
  es.onerror = () => { t.errors += 1; if (es.readyState === EventSource.CLOSED) t.closed = true; };
  window.t = t;
  return true;
};
"""
STATE = (
    "({payloads: t.payloads, losses: t.losses, unavailable: t.unavailable, opens: t.opens, closed: t.closed})"
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    with Chromium(tmp_path) as chromium:
        yield chromium


@pytest.fixture
def site() -> Iterator[Site]:
    other = Site()
    try:
        yield other
    finally:
        other.stop()


@pytest.fixture
def proxies() -> Iterator[list[FaultProxy]]:
    started: list[FaultProxy] = []
    yield started
    for proxy in started:
        proxy.stop()


def origin(site: Site, host: str = "127.0.0.1") -> str:
    return site.url(host).rstrip("/")


def metric(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def wait_until(what: str, check: Callable[[], Any], timeout: float = 20.0, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(every)
    return value


def tracking(page: Page, base: str, path: str) -> None:
    """Open a page of the server at `base` (its /healthz: any of its pages will do), and in it
    an EventSource on `path`, of the same origin."""
    page.navigate(base + "/healthz")
    assert page.evaluate(TRACK + f"track({json.dumps(path)})")
    page.wait_for("t.opens >= 1")


def state(page: Page) -> dict[str, Any]:
    value: dict[str, Any] = page.evaluate(STATE)
    return value


def publish(server: ServerProcess, key: str, n: int) -> list[str]:
    """n messages to `key` over the partitions, flushed; their payloads (`key`-i)."""
    payloads = [f"{key}-{i}" for i in range(n)]
    with broky.connect_sync(server.url) as client:
        for i, payload in enumerate(payloads):
            client.publish(key, payload.encode(), partition=PARTITIONS[i % len(PARTITIONS)])
        client.flush()
    return payloads


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fill(server: ServerProcess, n: int) -> list[socket.socket]:
    """n ndjson streams, each holding one of the server's HTTP connections (a refused one is
    tried again while the server sees others go); the caller closes them."""
    held: list[socket.socket] = []
    deadline = time.monotonic() + 10
    while len(held) < n:
        assert time.monotonic() < deadline, f"{len(held)} of {n} connections taken"
        sock = socket.create_connection((server.host, server.metrics_port), timeout=10)
        sock.sendall(b"GET /v1/sub/filler.x HTTP/1.1\r\nHost: x\r\n\r\n")
        head = sock.recv(65536)
        if head.startswith(b"HTTP/1.1 200 OK"):
            held.append(sock)
            continue
        assert head.startswith((b"HTTP/1.0 503 ", b"HTTP/1.1 503 ")), head
        sock.close()
        time.sleep(0.05)
    return held


@pytest.mark.timeout(90)
def test_an_id_resumed_twice_in_chromium_loses_nothing(
    start_server: Callable[..., ServerProcess], browser: Chromium, proxies: list[FaultProxy]
) -> None:
    # A reconnect that dies before its first event is followed by another with the same
    # Last-Event-ID; what was published meanwhile is retained, and must all arrive.
    s = start_server()
    proxy = FaultProxy((s.host, s.metrics_port)).start()
    proxies.append(proxy)
    page = browser.new_page()
    tracking(page, f"http://{proxy.address}", "/v1/sub/twice.>")
    sent = publish(s, "twice.a", 100)
    page.wait_for(f"t.payloads.length >= {len(sent)}")
    proxy.cut()  # the browser reconnects with the id of its last event
    wait_until("the resume", lambda: metric(s, "broky_http_resumed_total") >= 1)
    page.wait_for("t.opens >= 2")
    proxy.refuse(True)  # that reconnect dies before its first event (nothing was new)
    sent += publish(s, "twice.b", 100)  # retained while the browser is away
    time.sleep(1.5)  # (its reconnects, a second apart, are refused meanwhile)
    proxy.refuse(False)
    page.wait_for(f"t.payloads.length >= {len(sent)} || t.losses.length > 0")
    got = state(page)
    assert got["losses"] == [], got["losses"]
    assert sorted(got["payloads"]) == sorted(sent)  # each once
    assert metric(s, "broky_http_resumed_total") >= 2 and metric(s, "broky_http_resume_unknown_total") == 0


@pytest.mark.timeout(120)
def test_an_event_stream_in_chromium_goes_on_across_a_server_restart(browser: Chromium) -> None:
    # The restarted server's HTTP port answers while its workers start (held stopped here
    # for a few seconds, so that the browser's reconnects come meanwhile): a 503 then would
    # end the EventSource for good.
    ports = ("--port", str(free_port()), "--metrics-port", str(free_port()))
    first = ServerProcess(*ports).start()
    second = ServerProcess(*ports)
    try:
        page = browser.new_page()
        tracking(page, f"http://{first.host}:{first.metrics_port}", "/v1/sub/restart.>")
        sent = publish(first, "restart.before", 50)
        page.wait_for(f"t.payloads.length >= {len(sent)}")
        first.stop()
        starting = threading.Thread(target=second.start, kwargs={"timeout": 60.0})
        starting.start()
        # Its HTTP port answers, its workers are not ready yet (they take far longer to be
        # than the port to answer): hold them so.
        ready = f"http://127.0.0.1:{ports[3]}/readyz"
        wait_until(
            "the new HTTP port", lambda: _status(ready) == 503 and len(second.worker_pids()) == 2, every=0.005
        )
        stopped = second.worker_pids()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            assert _status(ready) == 503, "the workers were ready before they could be held"
            time.sleep(2.5)  # the browser's reconnects (a second apart) reach the new port meanwhile
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        starting.join(60)
        assert second.port, "the new server did not start"
        page.wait_for("t.opens >= 2 || t.closed")
        assert not state(page)["closed"], "the browser's EventSource gave up"
        sent += publish(second, "restart.after", 50)
        page.wait_for(f"t.payloads.length >= {len(sent)} || t.closed")
        got = state(page)
        assert sorted(got["payloads"]) == sorted(sent)
        # What the restart may have cost is told (the new server cannot know the old stream).
        assert {"dropped": None, "reason": "resume_unknown", "scope": "stream"} in got["losses"], got[
            "losses"
        ]
        assert all(loss["dropped"] is None or loss["dropped"] > 0 for loss in got["losses"])
    finally:
        first.stop()
        second.stop()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


@pytest.mark.timeout(90)
def test_an_event_stream_in_chromium_goes_on_while_the_http_connections_are_full(
    start_server: Callable[..., ServerProcess], browser: Chromium, proxies: list[FaultProxy]
) -> None:
    s = start_server("--http-max-connections", "3")
    proxy = FaultProxy((s.host, s.metrics_port)).start()
    proxies.append(proxy)
    page = browser.new_page()
    tracking(page, f"http://{proxy.address}", "/v1/sub/full.>")
    sent = publish(s, "full.a", 60)
    page.wait_for(f"t.payloads.length >= {len(sent)}")
    proxy.refuse(True)  # the browser's connections go, and it is kept out while
    held = fill(s, 3)  # other clients take every place
    proxy.refuse(False)
    try:
        sent += publish(s, "full.b", 60)
        page.wait_for("t.unavailable >= 1 || t.closed")  # its reconnect found the server full
        assert not state(page)["closed"], "the browser's EventSource gave up"
    finally:
        for sock in held:
            sock.close()
    page.wait_for(f"t.payloads.length >= {len(sent)} || t.closed || t.losses.length > 0")
    got = state(page)
    assert got["losses"] == [] and not got["closed"], got
    assert sorted(got["payloads"]) == sorted(sent)
    assert metric(s, "broky_http_refused_total") >= 1


@pytest.mark.timeout(90)
def test_a_page_of_another_origin_cannot_publish_with_the_cookie_nor_read_unless_allowed(
    start_server: Callable[..., ServerProcess], browser: Chromium, site: Site
) -> None:
    allowed = origin(site, "localhost")  # the same port under another name: another origin
    s = start_server("--auth-token", TOKEN, "--http-allow-origin", allowed)
    here = f"http://{s.host}:{s.metrics_port}"
    page = browser.new_page()
    # The visitor holds the token as a cookie of the server's host, SameSite=Strict: a page on
    # another port of that host is the same site, so the browser sends it along.
    page.call(
        "Network.setCookie",
        {"name": "broky_token", "value": TOKEN, "url": here + "/", "sameSite": "Strict", "httpOnly": True},
    )
    page.navigate(site.url())  # http://127.0.0.1:<site>: not allowed
    pub = json.dumps(f"{here}/v1/pub/csrf.x?lines=0")
    attack = f'fetch({pub}, {{method: "POST", mode: "no-cors", credentials: "include", body: "forged"}})'
    page.evaluate(f"{attack}.then(() => true)")
    page.wait_for("true")  # (the events of the request reach the page's records)
    assert (f"{here}/v1/pub/csrf.x?lines=0", 403) in page.responses
    assert any(f"broky_token={TOKEN}" in h.get("cookie", "") for h in page.sent_headers)  # it was sent
    # Nor can it read a stream, with the cookie or the token in the URL.
    for url in (f"{here}/v1/sub/csrf.>", f"{here}/v1/sub/csrf.>?access_token={TOKEN}"):
        page.evaluate(
            f"window.es = new EventSource({json.dumps(url)}, {{withCredentials: true}}); "
            "window.opened = false; es.onopen = () => { window.opened = true; }; true"
        )
        page.wait_for("es.readyState === EventSource.CLOSED")  # refused (403): closed for good
        assert page.evaluate("window.opened") is False
    read = f'fetch({json.dumps(f"{here}/v1/sub/csrf.>")}, {{credentials: "include"}})'
    assert page.evaluate(f"{read}.then(() => 'read', (e) => e.name)") == "TypeError"
    assert metric(s, "broky_http_published_total") == 0
    # The server's own pages may (the cookie is what it is for).
    page.navigate(here + "/healthz")
    same = 'fetch("/v1/pub/csrf.x?lines=0", {method: "POST", body: "own"}).then((r) => r.json())'
    assert page.evaluate(same)["published"] == 1
    # The allowed origin may publish (a preflight first: it sends a header) and read.
    page.navigate(site.url("localhost"))
    bearer = json.dumps({"Authorization": f"Bearer {TOKEN}"})
    allowed_pub = (
        f'fetch({pub}, {{method: "POST", headers: {bearer}, body: "allowed"}}).then((r) => r.json())'
    )
    assert page.evaluate(allowed_pub)["published"] == 1
    assert page.evaluate(TRACK + f"track({json.dumps(f'{here}/v1/sub/csrf.>?access_token={TOKEN}')})")
    page.wait_for("t.opens >= 1")
    assert page.evaluate(allowed_pub)["published"] == 1
    page.wait_for("t.payloads.includes('allowed')")
    assert metric(s, "broky_http_published_total") == 3
    assert page.evaluate("t.losses.length") == 0
