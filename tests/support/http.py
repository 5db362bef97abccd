"""The HTTP port of a real `broky serve`, as the tests read it: GET, /stats, /metrics.

`http_get` and `get` never raise on an HTTP error status (they return it); `debug_stats`
and `get_json` assert a 200 and return the JSON; `scrape` parses one /metrics scrape with
prometheus_client's parser and `value` picks one sample out of it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from tests.support.serverproc import ServerProcess


def http_get(server: ServerProcess, path: str) -> tuple[int, bytes]:
    url = f"http://{server.host}:{server.metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def debug_stats(server: ServerProcess) -> dict[str, Any]:
    status, body = http_get(server, "/stats")
    assert status == 200
    return json.loads(body)  # type: ignore[no-any-return]


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(server: ServerProcess, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    url = f"http://{server.host}:{server.metrics_port}{path}"
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def get_json(server: ServerProcess, path: str) -> Any:
    status, ctype, body = get(server, path)
    assert status == 200 and ctype == "application/json", (status, body)
    return json.loads(body)


def scrape(server: ServerProcess) -> tuple[dict[str, str], Samples]:
    """(metric family -> type, (sample name, labels) -> value) of one /metrics scrape."""
    status, ctype, body = get(server, "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4"), (status, ctype)
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[s.name, frozenset(s.labels.items())] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def sse_events(lines: list[bytes]) -> list[dict[str, str]]:
    """The complete SSE events in `lines` (each followed by its empty line): field -> value."""
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in lines:
        if not line:
            if current:
                events.append(current)
            current = {}
        elif not line.startswith(b":"):
            name, _, value = line.decode().partition(": ")
            current[name] = value
    return events
