"""Key patterns and the subscription matcher (a token trie with a bounded cache).

Keys are opaque bytes made of tokens separated by b".". A pattern is a key
in which a token may be `*` (exactly one token) or, as the last token, `>`
(one or more tokens). Wildcards are whole tokens; empty tokens are not allowed
in patterns.

Theory of operation
-------------------
Patterns are stored in a trie, one level per token: each node has literal
children, an optional `*` child, the items whose pattern ends there and the
items whose pattern ends in `>` there. `match(key)` walks the trie and returns
every item whose pattern matches, then passes the list through `compile` (the
server turns it into a delivery plan) and caches the result by key. The
cache is bounded (cleared when full), holds only keys of at most
MAX_CACHED_KEY_BYTES (so its memory is bounded too) and is cleared on every
change, so a match on the hot path is one dict lookup. Nodes left empty by `remove` are pruned:
an unused pattern leaves no trace (and `compact` shrinks the root's and the pattern
counts' tables once most of their entries are gone).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from broky.errors import BadPatternError

T = TypeVar("T", bound=Hashable)
P = TypeVar("P")
K = TypeVar("K")
V = TypeVar("V")

STAR = b"*"
GT = b">"
MAX_PATTERN_BYTES = 4096
MAX_CACHED_KEY_BYTES = 256  # longer keys are matched every time: the cache must not pin big keys


def _shown(pattern: bytes) -> str:
    """A pattern for a message: as text in quotes, a byte that is not UTF-8 as \\xNN (not b'...')."""
    return "'" + pattern.decode(errors="backslashreplace") + "'"


def parse_pattern(pattern: bytes) -> list[bytes]:
    """Split and validate a pattern.

    Raises:
        BadPatternError: empty pattern or token, `>` not last, wildcard inside a token.
    """
    if not pattern:
        raise BadPatternError("empty pattern")
    if len(pattern) > MAX_PATTERN_BYTES:
        raise BadPatternError(f"pattern longer than {MAX_PATTERN_BYTES} bytes")
    tokens = pattern.split(b".")
    last = len(tokens) - 1
    for i, token in enumerate(tokens):
        if not token:
            raise BadPatternError(f"empty token in pattern {_shown(pattern)}")
        if token == GT and i != last:
            raise BadPatternError(f"'>' must be the last token in {_shown(pattern)}")
        if token not in (STAR, GT) and (b"*" in token or b">" in token):
            raise BadPatternError(f"wildcards must be whole tokens in {_shown(pattern)}")
    return tokens


def key_problem(key: bytes) -> str | None:
    """What makes `key` unfit to publish under ("has ...", "must ..."), or None: the rule
    `broky pub` and the SDK's publish share.

    A key is opaque bytes to the server, but an empty key, an empty token
    (`a..b`, `.a`, `a.`) or a `*` / `>` token is almost certainly a pattern or
    a missing value given where a key was meant: a wildcard in a published key
    does not fan out, and no literal subscription can name such a key. (`*` or
    `>` inside a token, `a*b`, is an ordinary byte.)
    """
    if not key:
        return "must not be empty"
    tokens = key.split(b".")
    if b"" in tokens:
        return "has an empty token"
    if STAR in tokens or GT in tokens:
        return "has a wildcard token: a published key is literal (patterns are for subscribing)"
    return None


def is_literal(pattern: bytes) -> bool:
    return all(t not in (STAR, GT) for t in pattern.split(b"."))


def pattern_matches(pattern_tokens: list[bytes], key: bytes) -> bool:
    """Reference matcher for one pattern (the trie must agree with it)."""
    key_tokens = key.split(b".")
    for i, token in enumerate(pattern_tokens):
        if token == GT:
            return len(key_tokens) > i
        if i >= len(key_tokens):
            return False
        if token != STAR and token != key_tokens[i]:
            return False
    return len(key_tokens) == len(pattern_tokens)


class _Node(Generic[T]):
    __slots__ = ("children", "star", "items", "gt_items")

    def __init__(self) -> None:
        self.children: dict[bytes, _Node[T]] = {}
        self.star: _Node[T] | None = None
        self.items: dict[T, None] = {}  # ordered set
        self.gt_items: dict[T, None] = {}

    def empty(self) -> bool:
        return not (self.children or self.star or self.items or self.gt_items)


class Matcher(Generic[T, P]):
    """Items indexed by pattern; `match` returns compile(matching items), cached."""

    def __init__(
        self,
        compile: Callable[[list[T]], P],
        cache_size: int = 65536,
    ) -> None:
        self._root: _Node[T] = _Node()
        self._compile = compile
        self._cache: dict[bytes, P] = {}
        self._cache_size = cache_size
        self.patterns: dict[bytes, int] = {}  # pattern -> number of items
        self.cache_hits = 0
        self.cache_misses = 0

    def __len__(self) -> int:
        return sum(self.patterns.values())

    def add(self, pattern: bytes, item: T) -> None:
        tokens = parse_pattern(pattern)
        node = self._root
        for token in tokens[:-1] if tokens[-1] == GT else tokens:
            if token == STAR:
                if node.star is None:
                    node.star = _Node()
                node = node.star
            else:
                node = node.children.setdefault(token, _Node())
        bucket = node.gt_items if tokens[-1] == GT else node.items
        if item in bucket:
            return
        bucket[item] = None
        self.patterns[pattern] = self.patterns.get(pattern, 0) + 1
        self._cache.clear()

    def remove(self, pattern: bytes, item: T) -> bool:
        """Remove one item; prune empty nodes. False if it was not there."""
        tokens = parse_pattern(pattern)
        gt = tokens[-1] == GT
        path: list[tuple[_Node[T], bytes]] = []
        node: _Node[T] | None = self._root
        for token in tokens[:-1] if gt else tokens:
            assert node is not None
            path.append((node, token))
            node = node.star if token == STAR else node.children.get(token)
            if node is None:
                return False
        assert node is not None
        bucket = node.gt_items if gt else node.items
        if item not in bucket:
            return False
        del bucket[item]
        count = self.patterns[pattern] - 1
        if count:
            self.patterns[pattern] = count
        else:
            del self.patterns[pattern]
        for parent, token in reversed(path):
            child = parent.star if token == STAR else parent.children[token]
            assert child is not None
            if not child.empty():
                break
            if token == STAR:
                parent.star = None
            else:
                del parent.children[token]
        self._cache.clear()
        return True

    def match(self, key: bytes) -> P:
        try:
            result = self._cache[key]
            self.cache_hits += 1
            return result
        except KeyError:
            pass
        self.cache_misses += 1
        found: dict[T, None] = {}
        self._walk(self._root, key.split(b"."), 0, found)
        result = self._compile(list(found))
        if len(key) > MAX_CACHED_KEY_BYTES:
            return result
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[key] = result
        return result

    def _walk(self, node: _Node[T], tokens: list[bytes], i: int, found: dict[T, None]) -> None:
        if node.gt_items and i < len(tokens):
            found.update(node.gt_items)
        if i == len(tokens):
            found.update(node.items)
            return
        child = node.children.get(tokens[i])
        if child is not None:
            self._walk(child, tokens, i + 1, found)
        if node.star is not None:
            self._walk(node.star, tokens, i + 1, found)

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    @property
    def cached(self) -> dict[bytes, P]:
        """The match cache itself (the same dict for the matcher's life; read-only
        use): a hot caller may look a key up here first and call `match` on a miss."""
        return self._cache

    def is_empty(self) -> bool:
        return self._root.empty() and not self.patterns

    def compact(self) -> None:
        """Shrink the two tables that may hold an entry per pattern, `patterns` and the
        root's children, when they are mostly empty: a dict keeps its table when keys
        are deleted, and emptied inner nodes are pruned but the root is not. Rare (after
        many subscriptions left); costs a copy of what remains when it shrinks one."""
        self.patterns = _compacted(self.patterns)
        self._root.children = _compacted(self._root.children)


def _compacted(d: dict[K, V]) -> dict[K, V]:
    """d, or a right-sized copy of d if its table is over 8 times what its entries need."""
    if sys.getsizeof(d) > 4096 + 8 * 48 * len(d):
        return dict(d)
    return d
