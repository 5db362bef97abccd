"""The Origin check and CORS of the HTTP port (broky.server.http.origins), sans-IO; the browser's
view of it is tests/server/http/test_http_browser.py."""

from __future__ import annotations

import argparse

import pytest

from broky.server import config
from broky.server.http.origins import OriginPolicy, normalize, parse_list


def test_origins_are_compared_without_case_and_without_a_default_port() -> None:
    assert normalize("HTTP://Example.COM:80") == "http://example.com"
    assert normalize("https://example.com:443") == "https://example.com"
    assert normalize("https://example.com:8443") == "https://example.com:8443"
    assert normalize("http://[::1]:9477") == "http://[::1]:9477"
    assert parse_list(" http://a.test , https://b.test:1,,http://a.test") == (
        "http://a.test",
        "https://b.test:1",
    )
    for bad in ("*", "null", "a.test", "ftp://a.test", "http://a.test/", "http://a.test/x", "http://u@a.test",
                "http://a.test?x", "http://a.test:99999", "http://"):  # fmt: skip
        with pytest.raises(ValueError):
            normalize(bad)


def test_the_option_refuses_what_is_not_an_origin_and_names_the_flag() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--http-allow-origin", "http://localhost:8000,https://app.test"])
    assert config.from_args(args, {}).http_allow_origin == ("http://localhost:8000", "https://app.test")
    with pytest.raises(
        ValueError, match=r"BROKY_HTTP_ALLOW_ORIGIN='\*' \(sets --http-allow-origin\): '\*' is not"
    ):
        config.from_args(parser.parse_args([]), {"BROKY_HTTP_ALLOW_ORIGIN": "*"})
    assert config.from_args(parser.parse_args([]), {}).http_allow_origin == ()


def test_a_request_is_served_without_origin_from_its_own_origin_or_an_allowed_one() -> None:
    policy = OriginPolicy(["http://localhost:8000"])
    assert policy.verdict(None, "127.0.0.1:9477") == (True, ())  # a program: no Origin
    assert policy.verdict("http://127.0.0.1:9477", "127.0.0.1:9477") == (True, ())  # its own page
    assert policy.verdict("http://LOCALHOST", "localhost:80") == (True, ())
    served, cors = policy.verdict("http://localhost:8000", "127.0.0.1:9477")
    assert served and dict(cors) == {
        "Access-Control-Allow-Origin": "http://localhost:8000",
        "Access-Control-Allow-Credentials": "true",
        "Vary": "Origin",
    }
    for other in ("http://127.0.0.1:8000", "https://127.0.0.1:9477", "null", "http://localhost:8001"):
        assert policy.verdict(other, "127.0.0.1:9477") == (False, (("Vary", "Origin"),)), other
    assert policy.verdict("http://127.0.0.1:9477", None)[0] is False  # no Host: no own origin
    tls = OriginPolicy([], scheme="https")
    assert tls.verdict("https://h.test", "h.test:443")[0] and not tls.verdict("http://h.test", "h.test")[0]


def test_a_preflight_grants_the_paths_methods_and_the_headers_asked_for() -> None:
    policy = OriginPolicy(["http://localhost:8000"])
    headers = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
        "access-control-request-private-network": "true",
    }
    granted = dict(policy.preflight(headers, ("POST",)))
    assert granted["Access-Control-Allow-Methods"] == "POST"
    assert granted["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert granted["Access-Control-Allow-Private-Network"] == "true"
    assert granted["Access-Control-Max-Age"] == "600"
    odd = dict(policy.preflight({"access-control-request-headers": "x\r\ny"}, ("GET", "HEAD")))
    assert "Access-Control-Allow-Headers" not in odd  # not a list of header names: nothing granted
