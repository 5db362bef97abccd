"""The source's offsets: where a query stands in every vbucket, as checkpoint JSON.

A Spark offset of the ``broky`` source is one position per vbucket: (vbucket,
epoch, offset), the last offset already read (a read from it starts after
it, schema/README.md 5.2). Spark keeps it in the checkpoint as JSON, grouped
by epoch (a node's workers have one epoch each, so there are few)::

    {"epochs": {"8731100937518239301": {"0": 41, "1": 17, ...},
                "112094577351029001":  {"512": 0, ...}}}

Epochs are written as decimal strings (they are unsigned 64-bit numbers, which
JSON readers such as the JVM's do not all keep exact); offsets are numbers.
The same JSON is what option ``startingOffsets`` (and the batch read's
``endingOffsets``) takes: copy a checkpoint's offset, or build it from
`broky.Client.positions`; they also take those positions as JSON writes them
(``json.dumps(await client.positions())``: a list of [vbucket, epoch, offset],
read as the SDK reads `since`). A vbucket it does not name starts at the oldest
message retained (as Kafka's source starts a partition it discovers later):
nothing of it was read yet, so nothing is skipped.

Nothing here does I/O: the reader (`broky.spark.source`) asks the server and
hands the answers to these functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from broky.errors import BrokyError
from broky.protocol import VBUCKETS
from broky.protocol.frames import Position

_U64 = (1 << 64) - 1


class OffsetError(BrokyError, ValueError):
    """An offset JSON (an option, or a checkpoint) that is not one of ours."""


Offsets = dict[int, Position]  # by vbucket


def to_json(offsets: Mapping[int, Position]) -> dict[str, Any]:
    """The checkpoint form of `offsets` (deterministic: Spark compares offsets as JSON)."""
    epochs: dict[str, dict[str, int]] = {}
    for vb in sorted(offsets):
        p = offsets[vb]
        epochs.setdefault(str(p.epoch), {})[str(vb)] = p.offset
    return {"epochs": {e: epochs[e] for e in sorted(epochs, key=int)}}


def from_json(value: Mapping[str, Any] | list[Any] | str, what: str = "offset") -> Offsets:
    """Parse the checkpoint form (a dict, or its JSON text), or a list of positions.

    Raises:
        OffsetError: not valid JSON, not of the form above, a vbucket outside
            0..1023 or named twice, an epoch or offset that is not an unsigned
            64-bit integer. The message names `what` (e.g. the option).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise OffsetError(f"{what}: not JSON ({exc})") from None
    if isinstance(value, list):  # json.dumps(client.positions()): read as the SDK reads `since`
        from broky.client.reader import as_positions

        try:
            return {p.vbucket: p for p in as_positions(value, what)}
        except ValueError as exc:
            raise OffsetError(str(exc)) from None
    if not isinstance(value, Mapping) or set(value) != {"epochs"} or not isinstance(value["epochs"], Mapping):
        raise OffsetError(f'{what}: expected {{"epochs": {{"<epoch>": {{"<vbucket>": <offset>, ...}}}}}}')
    out: Offsets = {}
    for epoch_text, vbs in value["epochs"].items():
        epoch = _u64(epoch_text, f"{what}: epoch {epoch_text!r}")
        if not isinstance(vbs, Mapping):
            raise OffsetError(f"{what}: epoch {epoch_text}: expected an object of vbucket: offset")
        for vb_text, offset in vbs.items():
            vb = _vbucket(vb_text, what)
            if vb in out:
                raise OffsetError(f"{what}: vbucket {vb} is named twice")
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= _U64:
                raise OffsetError(
                    f"{what}: vbucket {vb}: offset {offset!r} is not an unsigned 64-bit integer"
                )
            out[vb] = Position(vb, epoch, offset)
    return out


def _u64(text: Any, what: str) -> int:
    if not isinstance(text, str) or not text.isdigit() or int(text) > _U64:
        raise OffsetError(f"{what} is not an unsigned 64-bit integer in decimal")
    return int(text)


def _vbucket(text: Any, what: str) -> int:
    if not isinstance(text, str) or not text.isdigit() or int(text) >= VBUCKETS:
        raise OffsetError(f"{what}: {text!r} is not a vbucket (0..{VBUCKETS - 1})")
    return int(text)


def ahead(start: Mapping[int, Position], latest: Mapping[int, Position]) -> dict[int, int]:
    """How many offsets each vbucket of `latest` is past `start` (a vbucket in another
    epoch: all of its current epoch's, up to its offset; not in `start`: likewise)."""
    out = {}
    for vb, q in latest.items():
        p = start.get(vb)
        n = q.offset - p.offset if p is not None and p.epoch == q.epoch else q.offset
        if n > 0:
            out[vb] = n
    return out


def moved_on(start: Mapping[int, Position], latest: Mapping[int, Position]) -> Offsets:
    """The end of a micro-batch from `start`: `start` where nothing is newer, `latest` where
    something is (or its epoch changed: the read from `start` then reports the loss)."""
    end = dict(start)
    for vb, q in latest.items():
        p = start.get(vb)
        if p is None or p.epoch != q.epoch or q.offset > p.offset:
            end[vb] = q
    return end


def limited(start: Mapping[int, Position], latest: Mapping[int, Position], max_offsets: int) -> Offsets:
    """The end of a micro-batch from `start` towards `latest` that spans at most `max_offsets`
    offsets, all vbuckets together (option ``maxOffsetsPerTrigger``, as Kafka's source does
    it: each vbucket gets a share in proportion to how far it is behind, rounded down, at
    least one offset each while the limit allows, so a query always makes progress).

    Offsets count every message of a vbucket; a pattern that matches some of them
    reads fewer rows than that.
    """
    behind = ahead(start, latest)
    total = sum(behind.values())
    if total <= max_offsets:
        return moved_on(start, latest)
    end = dict(start)
    for vb, q in latest.items():  # a new epoch with nothing in it yet: the loss is read now
        p = start.get(vb)
        if p is not None and p.epoch != q.epoch and vb not in behind:
            end[vb] = Position(vb, q.epoch, 0)
    budget = max_offsets
    for vb in sorted(behind, key=lambda v: (-behind[v], v)):
        if budget <= 0:
            break
        share = max(1, min(behind[vb], behind[vb] * max_offsets // total, budget))
        budget -= share
        q = latest[vb]
        p = start.get(vb)
        base = p.offset if p is not None and p.epoch == q.epoch else 0
        end[vb] = Position(vb, q.epoch, base + share)
    return end


def rows_between(start: Mapping[int, Position], end: Mapping[int, Position]) -> int:
    """Offsets (messages, before the pattern) from `start` to `end`."""
    return sum(ahead(start, end).values())


def changed(start: Mapping[int, Position], end: Mapping[int, Position]) -> list[int]:
    """The vbuckets whose range from `start` to `end` is not empty."""
    return sorted(
        ahead(start, end).keys() | {vb for vb, q in end.items() if vb in start and start[vb].epoch != q.epoch}
    )


def describe(vbuckets: Iterable[int]) -> str:
    """'3 vbuckets (17, 18, 514)', at most 8 named."""
    vbs = sorted(vbuckets)
    named = ", ".join(map(str, vbs[:8])) + (", ..." if len(vbs) > 8 else "")
    return f"{len(vbs)} vbucket{'s' if len(vbs) != 1 else ''} ({named})"
