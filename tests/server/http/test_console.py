"""The live console (broky.server.http.console) in a real headless Chromium against a real `broky serve`.

The page must load with no console error and fetch nothing but its own
server's endpoints, show the server's workers, and show traffic that starts
after it opened: a client's connection, its subscription, the messages it
published. The live tail reads GET /v1/sub (the HTTP subscribe endpoint):
while the server has none (404) the page must say so plainly; once it has,
the test expects the published message in the tail. A screenshot of each run
is kept in the test's tmp directory (its path is printed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import broky
from broky.server.http import console
from tests.support import requires
from tests.support.browser import Chromium, Page
from tests.support.cluster import Cluster, EtcdServer, wait_for
from tests.support.serverproc import ServerProcess

TOKEN = "console-secret-zq"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    with Chromium(tmp_path) as chromium:
        yield chromium


def origin(server: ServerProcess) -> str:
    return f"http://{server.host}:{server.metrics_port}"


def text_of(page: Page, selector: str) -> str:
    return str(page.evaluate(f"document.querySelector({json.dumps(selector)}).innerText"))


def sub_endpoint_status(server: ServerProcess, headers: dict[str, str] | None = None) -> int:
    """What the server answers GET /v1/sub/… (404 until the HTTP subscribe endpoint exists)."""
    request = urllib.request.Request(
        origin(server) + "/v1/sub/console.%3E", headers={"Accept": "text/event-stream", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_page_is_served_whole_and_fetches_nothing_from_elsewhere(server: ServerProcess) -> None:
    with urllib.request.urlopen(origin(server) + "/", timeout=5) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"] == "text/html; charset=utf-8"
        body = answer.read()
    assert body == console.page()
    html = body.decode()
    assert "default-src 'none'" in html and "connect-src 'self'" in html  # the CSP forbids other origins
    # No <script src>, <link href> or url() to another place: the only absolute URLs are the SVG
    # namespace and the link to another cluster member's own console, built from /stats.
    assert re.findall(r"\bsrc=", html) == []
    assert set(re.findall(r"https?://[^\s\"'<>]*", html)) == {"http://www.w3.org/2000/svg", "http://"}
    assert "url(" not in html and "@import" not in html
    head = urllib.request.Request(origin(server) + "/", method="HEAD")
    with urllib.request.urlopen(head, timeout=5) as answer:
        assert answer.status == 200 and answer.read() == b""


def test_console_shows_workers_and_traffic_in_chromium(
    server: ServerProcess, browser: Chromium, tmp_path: Path
) -> None:
    page = browser.new_page()
    page.navigate(origin(server) + "/")
    rows = page.wait_for(
        "(() => { const r = [...document.querySelectorAll('#workers tbody tr')].map(t => t.innerText);"
        " return r.length === 2 && r.every(t => /\\bup\\b/.test(t)) && r; })()"
    )
    pids = [str(p) for p in json.loads(_get(server, "/stats"))["master"]["worker_pids"]]
    assert all(pid in row for pid, row in zip(pids, rows, strict=True)), rows
    assert "2 workers up" in text_of(page, "#health")
    assert "single node" in text_of(page, "#nodes")
    assert "no connections" in text_of(page, "#connections")
    page.wait_for("document.querySelectorAll('#series polyline').length > 0")  # the chart has begun

    with broky.connect_sync(server.url, name="console-client-zq") as client:
        # Published while nobody subscribed: counted, shown, but not red (nobody missed them).
        for i in range(3):
            client.publish("nobody.listens", b"unheard", partition=f"kp-{i}")
        client.flush()
        page.wait_for("/no subscribers.*\\b3\\b/.test(document.querySelector('#losses').innerText)")
        assert page.evaluate("document.querySelectorAll('#losses .bad, #t-lost.bad').length") == 0
        sub = client.subscribe("console.>")
        for i in range(7):
            client.publish(f"console.event.{i}", b"hello from the SDK %d" % i, partition=f"kp-{i}")
        client.flush()
        assert len(list(sub.iter(timeout=2.0, count=7))) == 7
        # Published after the page opened: the totals, the client and its pattern appear.
        page.wait_for("/\\b10 in all\\b/.test(document.querySelector('#t-pub').innerText)")
        page.wait_for("/\\b7 in all\\b/.test(document.querySelector('#t-del').innerText)")
        page.wait_for("document.querySelector('#connections').innerText.includes('console-client-zq')")
        # Connection ids are 64-bit: shown exactly, not rounded to a double.
        ids = {str(c["id"]) for c in json.loads(_get(server, "/connections"))["connections"]}
        assert ids <= set(text_of(page, "#connections").split()), ids
        page.wait_for("document.querySelector('#topics').innerText.includes('console.>')")
        page.wait_for("document.querySelector('#workers').innerText.match(/\\bup\\b/g).length === 2")
        assert page.console_errors == [] and page.log_errors == [], (page.console_errors, page.log_errors)

        # The live tail, through the HTTP subscribe endpoint (/v1/sub) when the server has it.
        page.evaluate(
            "document.querySelector('#pattern').value = 'console.>';"
            "document.querySelector('#tailform').requestSubmit()"
        )
        if sub_endpoint_status(server) == 404:
            status = page.wait_for(
                "/needs \\/v1\\/sub/i.test(document.querySelector('#tailstatus').innerText)"
            )
            assert status
            assert "the live tail needs /v1/sub" in text_of(page, "#tailstatus").lower()
            # Chromium logs the 404 itself as a failed load: that, and nothing else, is expected.
            assert all(
                e["source"] == "network" and "/v1/sub/" in e.get("url", "") for e in page.log_errors
            ), page.log_errors
        else:
            page.wait_for("document.querySelector('#tailstatus').innerText.includes('Tailing')")
            client.publish("console.tail", b"seen in the tail", partition="kp-tail")
            client.flush()
            page.wait_for("document.querySelector('#tail').innerText.includes('seen in the tail')")
            row = page.evaluate("document.querySelector('#tail tbody tr').innerText")
            assert re.search(r"\d+ · \d+ \(epoch \d+\)", row), row  # its position, as /v1/sub gives it
            assert page.log_errors == [], page.log_errors
    assert page.console_errors == [], page.console_errors
    # The client is gone from the table (the HTTP gateway's own connections, which the tail
    # opened, stay: http-gateway).
    page.wait_for("!document.querySelector('#connections').innerText.includes('console-client-zq')")

    host = origin(server)
    assert page.requests and all(url.startswith(host + "/") for url in page.requests), page.requests
    shot = page.screenshot(tmp_path / "console.png")
    assert shot.stat().st_size > 10_000
    print(f"console screenshot: {shot}")


def test_a_worker_that_does_not_answer_is_red_and_comes_back(
    server: ServerProcess, browser: Chromium
) -> None:
    page = browser.new_page()
    page.navigate(origin(server) + "/")
    page.wait_for("document.querySelector('#health').innerText === '2 workers up'")
    assert page.evaluate("document.querySelectorAll('.bad').length") == 0  # nothing red when all is well
    pid = json.loads(_get(server, "/stats"))["master"]["worker_pids"][1]
    os.kill(pid, signal.SIGSTOP)  # it keeps its pid but answers nothing: the master reports it down
    try:
        page.wait_for("document.querySelector('#health').innerText === '1 of 2 workers down'")
        assert page.evaluate("document.querySelector('#health').classList.contains('bad')") is True
        row = page.wait_for(
            "(() => { const r = document.querySelectorAll('#workers tbody tr')[1];"
            " return r.querySelector('td.bad') && r.innerText; })()"
        )
        assert "down" in row and "no answer" in row
    finally:
        os.kill(pid, signal.SIGCONT)
    page.wait_for("document.querySelector('#health').innerText === '2 workers up'")
    page.wait_for("document.querySelectorAll('.bad').length === 0")
    assert page.console_errors == [] and page.log_errors == [], (page.console_errors, page.log_errors)


def test_a_server_that_stops_answering_is_red_on_the_page(
    start_server: Callable[..., ServerProcess], browser: Chromium
) -> None:
    server = start_server()
    page = browser.new_page()
    page.navigate(origin(server) + "/")
    page.wait_for("document.querySelector('#health').innerText === '2 workers up'")
    server.stop()
    page.wait_for("document.querySelector('#health').innerText === 'no answer'")
    assert page.evaluate("document.querySelector('#health').classList.contains('bad')") is True
    assert "the server does not answer" in text_of(page, "#banner")
    page.wait_for("/no answer for \\d+ s/.test(document.querySelector('#fresh').innerText)", timeout=15)
    assert page.console_errors == [], page.console_errors  # Chromium logs the refused connections itself
    assert all(e["source"] == "network" for e in page.log_errors), page.log_errors


def test_console_asks_for_the_token_and_keeps_it_for_the_tab(
    start_server: Callable[..., ServerProcess], browser: Chromium, tmp_path: Path
) -> None:
    server = start_server("--auth-token", TOKEN)
    page = browser.new_page()
    page.navigate(origin(server) + "/")
    # The server's own reason (the token is missing) is shown, with a field for it.
    page.wait_for("!document.querySelector('#tokenform').hidden")
    assert "needs the server's auth token" in text_of(page, "#banner")
    assert "Authorization: Bearer" in text_of(page, "#banner")
    page.evaluate(
        f"document.querySelector('#token').value = {json.dumps(TOKEN)};"
        "document.querySelector('#tokenform').requestSubmit()"
    )
    page.wait_for("document.querySelectorAll('#workers tbody tr').length === 2")
    assert page.evaluate("document.querySelector('#banner').classList.contains('show')") is False
    # A reload in the same tab keeps it (sessionStorage): no second prompt.
    page.navigate(origin(server) + "/")
    page.wait_for("document.querySelectorAll('#workers tbody tr').length === 2")
    assert page.evaluate("document.querySelector('#tokenform').hidden") is True
    # A wrong token is refused with the server's reason, and can be replaced.
    page.evaluate("sessionStorage.setItem('broky.token', 'wrong')")
    page.navigate(origin(server) + "/")  # waits for the load (a reload from the page would race it)
    page.wait_for("/wrong auth token/.test(document.querySelector('#banner').innerText)")
    assert page.console_errors == [], page.console_errors
    # The only failed loads are the 401s the server answered before the token was given.
    assert page.log_errors and all(
        e["source"] == "network" and "401" in e["text"] for e in page.log_errors
    ), page.log_errors
    page.screenshot(tmp_path / "console-token.png")


def test_the_tail_parses_server_sent_events_and_draws_a_clients_bytes_as_text(
    server: ServerProcess, browser: Chromium
) -> None:
    """The tail's SSE parser and its rows, in the browser (the stream itself comes from /v1/sub)."""
    page = browser.new_page()
    page.navigate(origin(server) + "/")
    stream = (
        ": a comment\n\n"
        'id: 517:3:10000\ndata: {"key": "orders.eu", "payload": "a"}\n\n'
        'event: loss\r\ndata: {"dropped": 3,\r\ndata:  "reason": "slow_consumer"}\r\n\r\n'
        "id: 517:3:10001\ndata:x"
    )
    events, rest = page.evaluate(f"window.brokyParseSSE({json.dumps(stream)})")
    assert events == [
        {"event": "message", "data": '{"key": "orders.eu", "payload": "a"}', "id": "517:3:10000"},
        {"event": "loss", "data": '{"dropped": 3,\n "reason": "slow_consumer"}', "id": None},
    ]
    assert rest == "id: 517:3:10001\ndata:x"  # an event is not complete before its blank line
    # Drawn as the tail draws what /v1/sub streams: a client's bytes are text, never markup.
    hostile = "<img src=x onerror='window.pwned=1'>"
    # (as the gateway writes it: the position's fields at the top level, the epoch a string; the
    # id, which carries the stream's resume secret, is not shown)
    message = {"key_partition": "kp-1", "key": "orders.eu", "payload": hostile,
               "vbucket": 517, "epoch": "3", "offset": 10000}  # fmt: skip
    streamed = {"event": "message", "data": json.dumps(message), "id": "ep.3.7ps.1.SECRETx"}
    page.evaluate(f"window.brokyTailEvent({json.dumps(streamed)})")
    loss = {"dropped": 3, "reason": "slow_consumer", "scope": "gateway"}
    page.evaluate(
        f"window.brokyTailEvent({json.dumps({'event': 'loss', 'data': json.dumps(loss), 'id': None})})"
    )
    rows = page.evaluate(
        "[...document.querySelectorAll('#tail tbody tr')].map(r => [r.className, r.innerText])"
    )
    assert rows[0][0] == "loss" and "lost 3 message(s): slow_consumer" in rows[0][1], rows  # newest first
    assert "517 · 10000 (epoch 3)" in rows[1][1] and "orders.eu" in rows[1][1] and hostile in rows[1][1], rows
    assert "SECRET" not in page.evaluate("document.querySelector('#tail').innerText")
    assert page.evaluate("document.querySelectorAll('#tail img').length") == 0
    assert page.evaluate("window.pwned === undefined") is True
    assert page.console_errors == []


def test_nodes_of_a_cluster_are_listed_with_the_leader_and_links_to_their_consoles(browser: Chromium) -> None:
    requires.program("etcd")
    etcd = EtcdServer().start()
    cluster = Cluster(etcd)
    try:
        a = cluster.start("node-a")
        b = cluster.start("node-b")
        wait_for(lambda: len(cluster.stats("node-a")["cluster"]["members"]) == 2, 30.0, "two members")
        page = browser.new_page()
        page.navigate(origin(a) + "/")
        rows = page.wait_for(
            "(() => { const r = [...document.querySelectorAll('#nodes tbody tr')].map(t => t.innerText);"
            " return r.length === 2 && r; })()"
        )
        leader = cluster.stats("node-a")["cluster"]["leader"]
        assert any(row.startswith(f"{leader} · leader") for row in rows), rows
        assert any("node-a" in row and "this one" in row for row in rows), rows
        assert all("serving" in row for row in rows), rows
        link = page.evaluate("document.querySelector('#nodes a').href")
        assert link == f"http://{b.host}:{b.metrics_port}/"  # node-b's own console
        assert "node node-a" in text_of(page, "#node")
        assert page.console_errors == [] and page.log_errors == [], (page.console_errors, page.log_errors)
    finally:
        cluster.stop()
        etcd.stop()


def test_the_theme_follows_the_system_until_the_button_chooses(
    server: ServerProcess, browser: Chromium
) -> None:
    page = browser.new_page()
    background = "getComputedStyle(document.body).backgroundColor"
    for scheme, colour in (("dark", "rgb(14, 18, 23)"), ("light", "rgb(244, 246, 248)")):
        page.call(
            "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]}
        )
        page.navigate(origin(server) + "/")
        page.wait_for("document.querySelectorAll('#workers tbody tr').length === 2")
        assert page.evaluate(background) == colour, scheme
    assert page.evaluate("document.querySelector('#theme').innerText") == "Theme: auto"
    page.evaluate("document.querySelector('#theme').click()")  # auto -> dark, over the system's light
    assert page.evaluate(background) == "rgb(14, 18, 23)"
    page.navigate(origin(server) + "/")  # the choice is kept (localStorage: a preference, not a secret)
    assert page.evaluate("document.querySelector('#theme').innerText") == "Theme: dark"
    assert page.evaluate(background) == "rgb(14, 18, 23)"
    assert page.console_errors == [] and page.log_errors == []


def _get(server: ServerProcess, path: str) -> Any:
    with urllib.request.urlopen(origin(server) + path, timeout=5) as answer:
        return answer.read()
