"""The Spark source's offsets (broky.spark.offsets): the checkpoint JSON and the batch ends."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broky.protocol.frames import Position
from broky.spark import offsets as off

E1, E2 = 8731100937518239301, (1 << 64) - 1


def ps(*items: tuple[int, int, int]) -> dict[int, Position]:
    return {vb: Position(vb, e, o) for vb, e, o in items}


def test_the_checkpoint_json_groups_by_epoch_and_keeps_u64_epochs_exact() -> None:
    offsets = ps((2, E1, 41), (10, E1, 0), (512, E2, 7))
    doc = off.to_json(offsets)
    assert doc == {"epochs": {str(E1): {"2": 41, "10": 0}, str(E2): {"512": 7}}}
    text = json.dumps(doc)
    assert off.from_json(text) == offsets == off.from_json(doc)
    # deterministic: the same offsets give the same text, whatever the order they came in
    assert json.dumps(off.to_json(dict(reversed(list(offsets.items()))))) == text
    # positions as JSON writes them (json.dumps(client.positions())) are taken too
    assert off.from_json(json.dumps(list(offsets.values())), "startingOffsets") == offsets


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{", "not JSON"),
        ('{"2": 41}', "expected"),
        ('{"epochs": {"12": {"1024": 1}}}', "not a vbucket"),
        ('{"epochs": {"12": {"-1": 1}}}', "not a vbucket"),
        ('{"epochs": {"x": {"1": 1}}}', "epoch 'x'"),
        ('{"epochs": {"18446744073709551616": {"1": 1}}}', "not an unsigned 64-bit"),
        ('{"epochs": {"12": {"1": -1}}}', "offset -1"),
        ('{"epochs": {"12": {"1": 1.5}}}', "offset 1.5"),
        ('{"epochs": {"12": {"1": true}}}', "offset True"),
        ('{"epochs": {"12": {"1": 1}, "13": {"1": 2}}}', "vbucket 1 is named twice"),
        ('{"epochs": {"12": [1]}}', "object of vbucket"),
        ("[[1, 12]]", "[1, 12] is not a position"),
        ("[[1, 12, 3], [1, 13, 4]]", "vbucket 1 is named twice"),
    ],
)
def test_a_bad_offset_json_is_refused_naming_what_is_wrong(value: str, says: str) -> None:
    with pytest.raises(off.OffsetError, match="startingOffsets") as err:
        off.from_json(value, "startingOffsets")
    assert says in str(err.value)


def test_a_batch_moves_on_only_where_something_is_newer_or_the_epoch_changed() -> None:
    start = ps((1, E1, 5), (2, E1, 9), (3, E1, 4))
    latest = ps((1, E1, 5), (2, E1, 12), (3, E2, 0), (4, E1, 3))
    end = off.moved_on(start, latest)
    assert end == ps((1, E1, 5), (2, E1, 12), (3, E2, 0), (4, E1, 3))
    assert off.changed(start, end) == [2, 3, 4]
    assert off.rows_between(start, end) == 3 + 3
    assert off.changed(end, end) == []


@given(
    st.dictionaries(st.integers(0, 1023), st.tuples(st.integers(0, 50), st.integers(0, 500)), max_size=40),
    st.integers(1, 2000),
)
def test_max_offsets_bounds_a_batch_and_it_always_progresses(
    behind: dict[int, tuple[int, int]], limit: int
) -> None:
    start = {vb: Position(vb, E1, base) for vb, (base, _) in behind.items()}
    latest = {vb: Position(vb, E1, base + more) for vb, (base, more) in behind.items()}
    end = off.limited(start, latest, limit)
    total = off.rows_between(start, latest)
    taken = off.rows_between(start, end)
    assert taken <= limit
    if total:
        assert taken > 0  # never stuck
    for vb, p in end.items():  # within the range, never past latest
        assert start[vb].offset <= p.offset <= latest[vb].offset
    if total <= limit:
        assert end == off.moved_on(start, latest)


def test_max_offsets_shares_in_proportion_and_takes_a_new_epoch_at_once() -> None:
    start = ps((1, E1, 0), (2, E1, 0), (3, E1, 100))
    latest = ps((1, E1, 300), (2, E1, 100), (3, E2, 0))
    end = off.limited(start, latest, 200)
    assert end[1] == Position(1, E1, 150) and end[2] == Position(2, E1, 50)
    assert end[3] == Position(3, E2, 0)  # nothing in it yet: the read reports the gone epoch now
