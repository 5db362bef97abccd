"""Take the docs' screenshot of the live console (docs/console.png) against a busy server.

    .venv/bin/python scripts/console_screenshot.py [--out docs/console.png] [--seconds 45] [--light]

Starts a real `broky serve` (2 workers) and some traffic: a producer whose rate
rises and falls, two plain subscribers, an acknowledging consumer group of two
members, a few messages nobody subscribed to; opens the console in headless
Chromium (tests/support/browser.py: Debian's chromium, the DevTools protocol), starts
the live tail, and saves a screenshot once a minute's chart has mostly filled.
Everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import broky
from tests.support.browser import Chromium
from tests.support.serverproc import ServerProcess


def produce(url: str, stop: threading.Event) -> None:
    with broky.connect_sync(url, name="checkout-api") as client:
        started = time.monotonic()
        n = 0
        while not stop.is_set():
            t = time.monotonic() - started
            burst = int(40 + 30 * math.sin(t / 6) + (60 if 20 < t % 40 < 24 else 0))
            for _ in range(burst):
                n += 1
                region = ("eu", "us", "ap")[n % 3]
                client.publish(
                    f"orders.{region}.created", b'{"order": %d}' % n, partition=f"customer-{n % 977}"
                )
            if n % 50 == 0:
                client.publish("audit.unrouted", b"nobody listens here", partition=f"customer-{n % 977}")
            time.sleep(0.05)


def consume(url: str, name: str, pattern: str, stop: threading.Event, group: str | None = None) -> None:
    with broky.connect_sync(url, name=name) as client:
        sub = client.subscribe(pattern, group=group, ack=group is not None)
        while not stop.is_set():
            for msg in sub.iter(timeout=0.2, count=1000):
                if group is not None:
                    msg.ack()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/console.png"))
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--light", action="store_true", help="the light theme (default: dark)")
    args = parser.parse_args()
    server = ServerProcess(workers=2).start()
    stop = threading.Event()
    threads = [
        threading.Thread(target=produce, args=(server.url, stop)),
        threading.Thread(target=consume, args=(server.url, "dashboard", "orders.>", stop)),
        threading.Thread(target=consume, args=(server.url, "eu-fraud-check", "orders.eu.*", stop)),
        threading.Thread(target=consume, args=(server.url, "billing-1", "orders.>", stop, "billing")),
        threading.Thread(target=consume, args=(server.url, "billing-2", "orders.>", stop, "billing")),
    ]
    try:
        for thread in threads[1:]:
            thread.start()
        time.sleep(1.0)
        threads[0].start()
        with (
            tempfile.TemporaryDirectory(prefix="broky-console-") as tmp,
            Chromium(Path(tmp), 1400, 1000) as chromium,
        ):
            page = chromium.new_page()
            scheme = "light" if args.light else "dark"
            page.call(
                "Emulation.setEmulatedMedia",
                {"features": [{"name": "prefers-color-scheme", "value": scheme}]},
            )
            page.navigate(f"http://{server.host}:{server.metrics_port}/")
            page.wait_for("document.querySelectorAll('#workers tbody tr').length === 2")
            time.sleep(args.seconds)
            page.evaluate(
                "document.querySelector('#pattern').value = 'orders.eu.>';"
                "document.querySelector('#tailform').requestSubmit()"
            )
            time.sleep(2.0)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(args.out)
            if page.console_errors:
                print("console errors:", page.console_errors, file=sys.stderr)
        print(f"wrote {args.out}")
    finally:
        stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(10)
        server.stop()


if __name__ == "__main__":
    main()
