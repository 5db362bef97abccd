"""Which implementation of the SDK's publish encoding this process runs.

The publish path (broky.client.publisher) is written in Python and stays the
reference: `PublishEncoder` templates packed with `struct`, the KSUID sequence
of broky.protocol.ksuid. Its two loops have a compiled twin,
`broky.client._pubpack` (a small C extension that `pip install` builds with
the server's when a C compiler is there; see its header):

- `stamp`: a template's sample frame with the time, the next uid and the
  payload written in;
- `FastPath.publish`, publish's per-call fast path: the cache lookup, `stamp`,
  and the Link's bookkeeping (the frame appended to its outbound list and
  counted, its write scheduled), reading the Link's state from C
  (`LinkState`, the base class of broky.client.link.Link when the twin is
  built);
- `pack_rows`, publish_many's loop (and the Spark sink's): each row encoded
  and appended to its Link's outbound list, in C, until a row that the
  Python path must take (a new key_partition, a field that is not bytes, a
  down worker, a full batch, a new second).

Both read and advance the KSUID sequence in C (`Sequence`, below, is
KsuidSequence's state in a C struct with KsuidSequence's own methods). The
twin is used when it was built and matches this code; otherwise publishing
runs the pure Python loops (the same bytes at two to several times the CPU
per message), and `broky.client.pubpack.description` says why.
BROKY_PURE_PYTHON=1 chooses the pure-Python loops on purpose (to compare the
two), as it does for the server's fan-out.

The twin takes every position of the canonical layout from its owner,
broky.protocol.layout, handed to its configure() here at import; a twin that
refuses that layout (a change it cannot hold) leaves the pure-Python loops in
charge, and `description` says why.
"""

from __future__ import annotations

import os
from typing import Any

from broky.protocol import layout
from broky.protocol.ksuid import KsuidSequence

ENV_PURE = "BROKY_PURE_PYTHON"
VERSION = 5  # the _pubpack.c interface this code calls (its PUBPACK_VERSION)


def pure_requested() -> bool:
    return os.environ.get(ENV_PURE, "") not in ("", "0")


def _load() -> tuple[Any, str]:
    if pure_requested():
        return None, f"pure Python ({ENV_PURE} is set)"
    try:
        from broky.client import _pubpack
    except ImportError as exc:
        return (
            None,
            f"pure Python: the compiled publish path is not built ({exc}); reinstall with a C compiler",
        )
    if getattr(_pubpack, "VERSION", None) != VERSION:
        return None, "pure Python: the compiled publish path is out of date; reinstall (pip install -e .)"
    try:
        _pubpack.configure(layout)
    except ValueError as exc:
        return None, f"pure Python: {exc}"
    return _pubpack, "compiled"


compiled, description = _load()


def new_sequence() -> KsuidSequence:
    """A KSUID sequence the compiled twin can advance (a KsuidSequence when there is none)."""
    if compiled is None:
        return KsuidSequence()
    seq: KsuidSequence = Sequence()
    return seq


if compiled is not None:

    class Sequence(compiled.Sequence):  # type: ignore[misc,name-defined]
        """KsuidSequence with its state in C (broky.client._pubpack.Sequence): same methods."""

        __slots__ = ("__weakref__",)
        __init__ = KsuidSequence.__init__
        roll = KsuidSequence.roll
        new = KsuidSequence.new


__all__ = ["compiled", "description", "new_sequence", "pure_requested"]
