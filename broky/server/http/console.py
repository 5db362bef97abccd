"""The live console: one page at / on the metrics port, for an operator.

Theory of operation
-------------------
The page is one self-contained file, console.html (package data, read once at
install): its style and script are inline, it loads nothing else (no build
step, no CDN, no font, no icon: the machine that runs Broky may have no
internet, and its Content-Security-Policy, a meta tag, forbids every other
origin), and it holds no data of its own. The server only serves it; every
figure on it comes from the JSON endpoints of broky.server.http.monitor, which the
page polls (/stats each second; /connections and /topics every few seconds;
nothing while the tab is hidden):

    nodes, workers, consumer groups, losses by reason    /stats
    connections (the busiest)                            /connections
    subscriptions (patterns, most subscribed first)      /topics
    the live tail of a pattern                           GET /v1/sub/PATTERN, Accept: text/event-stream

Rates (a chart of the last minute) are the page's own differences between
two polls of one worker with the same pid (a restarted worker's counters
start again at zero: no negative rate), so they begin when the page opens.

The page itself is open, like /metrics: it lists nothing. The endpoints it
reads are `private` when the server has an --auth-token; the page then asks
for the token and sends it as "Authorization: Bearer <token>", keeping it in
the tab's sessionStorage: never in the URL (history, proxies' logs), gone
when the tab closes, and not a cookie the browser would send by itself. The
tail reads the event stream with fetch() rather than EventSource, which can
neither send that header nor see a 404; it resumes after a cut with
Last-Event-ID, and says "the live tail needs /v1/sub" when the server answers
404 (a server without the HTTP subscribe endpoint).
"""

from __future__ import annotations

from pathlib import Path

from broky.server.http.server import HttpServer, Request, Response

PAGE = "console.html"
CONTENT_TYPE = "text/html; charset=utf-8"


def page() -> bytes:
    """The console's page, as shipped with the package."""
    return Path(__file__).with_name(PAGE).read_bytes()  # not importlib.resources: 10 ms of imports


def install(http: HttpServer) -> None:
    """Serve the console at / (open: the page holds no data, see the theory of operation)."""
    body = page()

    async def console(request: Request) -> Response:
        return 200, CONTENT_TYPE, body

    http.route("/", console)
