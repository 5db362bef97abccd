"""The subscription matcher agrees with the reference matcher and leaves no trace."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broky.errors import BadPatternError, BrokyError, ErrorCode, ProtocolError
from broky.matching import MAX_PATTERN_BYTES, Matcher, is_literal, parse_pattern, pattern_matches

# A tiny alphabet so that random keys and patterns actually meet.
literal_tokens = st.sampled_from([b"a", b"b", b"c", b"orders", b"x-1"])
key_tokens = literal_tokens | st.just(b"") | st.just(b"*") | st.just(b">")  # keys are opaque bytes
keys = st.lists(key_tokens, min_size=1, max_size=5).map(b".".join)


@st.composite
def patterns(draw: st.DrawFn) -> bytes:
    tokens = draw(st.lists(literal_tokens | st.just(b"*"), min_size=0, max_size=4))
    if not tokens or draw(st.booleans()):
        tokens.append(b">" if draw(st.booleans()) else draw(literal_tokens | st.just(b"*")))
    return b".".join(tokens)


subscriptions = st.lists(st.tuples(patterns(), st.integers(0, 5)), max_size=25)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def new_matcher(cache_size: int = 65536) -> Matcher[tuple[bytes, int], frozenset[tuple[bytes, int]]]:
    return Matcher(frozenset, cache_size=cache_size)


def expected(subs: set[tuple[bytes, int]], key: bytes) -> frozenset[tuple[bytes, int]]:
    return frozenset(s for s in subs if pattern_matches(parse_pattern(s[0]), key))


@SETTINGS
@given(subscriptions, st.lists(keys, min_size=1, max_size=20))
def test_matcher_agrees_with_reference(subs: list[tuple[bytes, int]], probe: list[bytes]) -> None:
    m = new_matcher()
    for pattern, sid in subs:
        m.add(pattern, (pattern, sid))
    live = set(subs)
    assert len(m) == len(live)
    for key in probe:
        assert m.match(key) == expected(live, key)
        assert m.match(key) == expected(live, key)  # second time from the cache
    assert m.cache_hits >= len(probe)
    assert m.cache_misses == len(set(probe))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subscriptions, st.randoms(use_true_random=False), st.lists(keys, max_size=6))
def test_add_remove_in_any_order_leaves_an_empty_trie(
    subs: list[tuple[bytes, int]], rnd: random.Random, probe: list[bytes]
) -> None:
    m = new_matcher()
    live: set[tuple[bytes, int]] = set()
    ops = [(True, s) for s in subs] + [(False, s) for s in subs]
    rnd.shuffle(ops)
    for add, (pattern, sid) in ops:
        if add:
            m.add(pattern, (pattern, sid))
            live.add((pattern, sid))
        else:
            assert m.remove(pattern, (pattern, sid)) == ((pattern, sid) in live)
            live.discard((pattern, sid))
        for key in probe:
            assert m.match(key) == expected(live, key)
    for pattern, sid in list(live):
        assert m.remove(pattern, (pattern, sid))
    assert m.is_empty()
    assert len(m) == 0 and m.patterns == {}
    for key in probe:
        assert m.match(key) == frozenset()


def test_cache_is_invalidated_on_every_change() -> None:
    m = new_matcher()
    assert m.match(b"orders.eu.created") == frozenset()
    assert m.cache_len == 1
    m.add(b"orders.*.created", (b"p", 1))
    assert m.cache_len == 0
    assert m.match(b"orders.eu.created") == {(b"p", 1)}
    m.add(b"orders.>", (b"q", 2))
    assert m.match(b"orders.eu.created") == {(b"p", 1), (b"q", 2)}
    assert m.remove(b"orders.*.created", (b"p", 1))
    assert m.match(b"orders.eu.created") == {(b"q", 2)}
    # A no-op (duplicate add, removing what is not there) still gives right answers.
    m.add(b"orders.>", (b"q", 2))
    assert not m.remove(b"orders.*.created", (b"p", 1))
    assert not m.remove(b"nothing.here", (b"p", 1))
    assert m.match(b"orders.eu.created") == {(b"q", 2)}
    assert len(m) == 1


def test_cache_is_bounded() -> None:
    m = new_matcher(cache_size=4)
    m.add(b">", (b">", 0))
    for i in range(50):
        assert m.match(b"k.%d" % i) == {(b">", 0)}
        assert m.cache_len <= 4


def test_one_item_under_several_patterns_is_returned_once() -> None:
    # The server indexes connections: a connection matching twice gets one delivery.
    m: Matcher[str, list[str]] = Matcher(sorted)
    m.add(b"a.*", "conn-1")
    m.add(b"a.>", "conn-1")
    m.add(b"a.b", "conn-2")
    assert m.match(b"a.b") == ["conn-1", "conn-2"]
    assert len(m) == 3
    m.remove(b"a.*", "conn-1")
    assert m.match(b"a.b") == ["conn-1", "conn-2"]
    m.remove(b"a.>", "conn-1")
    assert m.match(b"a.b") == ["conn-2"]


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        (b"a.b", b"a.b", True),
        (b"a.b", b"a.b.c", False),
        (b"a.*", b"a.b", True),
        (b"a.*", b"a", False),
        (b"a.*", b"a.b.c", False),
        (b"a.>", b"a.b", True),
        (b"a.>", b"a.b.c", True),
        (b"a.>", b"a", False),
        (b">", b"a", True),
        (b"*", b"a", True),
        (b"*", b"a.b", False),
        (b"*.*.>", b"a.b", False),
        (b"*.*.>", b"a.b.c", True),
        (b"a.*", b"a.", True),  # keys are opaque: an empty token is a token
    ],
)
def test_pattern_syntax(pattern: bytes, key: bytes, matches: bool) -> None:
    assert pattern_matches(parse_pattern(pattern), key) is matches
    m: Matcher[int, list[int]] = Matcher(list)
    m.add(pattern, 1)
    assert m.match(key) == ([1] if matches else [])


@pytest.mark.parametrize(
    "pattern",
    [b"", b".", b"a.", b".a", b"a..b", b"a.>.b", b">.a", b"a*", b"*a", b"a.b>", b"a.>>", b"**", b"x" * 4097],
)
def test_bad_patterns_are_refused(pattern: bytes) -> None:
    m: Matcher[int, list[int]] = Matcher(list)
    with pytest.raises(BadPatternError) as info:
        m.add(pattern, 1)
    assert info.value.code == ErrorCode.BAD_PATTERN
    assert isinstance(info.value, ProtocolError) and isinstance(info.value, BrokyError)
    assert m.is_empty()
    with pytest.raises(BadPatternError):
        m.remove(pattern, 1)


def test_longest_pattern_is_accepted() -> None:
    pattern = b".".join([b"x" * 99] * 40) + b"." + b"y" * (MAX_PATTERN_BYTES - 4000)
    assert len(pattern) == MAX_PATTERN_BYTES
    assert parse_pattern(pattern)[-1] == b"y" * 96


def test_is_literal() -> None:
    assert is_literal(b"a.b.c")
    assert not is_literal(b"a.*.c")
    assert not is_literal(b"a.>")
