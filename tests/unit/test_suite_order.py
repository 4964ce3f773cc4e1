"""The test suite's own order under pytest-xdist (tests/conftest.py): the longest groups are handed
out first, the others by their number of tests, each group's tests in their collected order; the
list of the longest names groups that exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from tests.conftest import LONGEST_FIRST, longest_first
from tests.support.fixtures import DEMO_GROUP

ROOT = Path(__file__).resolve().parents[2]


class _Item:
    """What ``longest_first`` reads of a collected test: its node id and its group marker."""

    def __init__(self, nodeid: str, group: str) -> None:
        self.nodeid = nodeid
        self._marker = pytest.mark.xdist_group(group).mark

    def get_closest_marker(self, name: str) -> Any:
        return self._marker if name == "xdist_group" else None


def test_the_longest_groups_go_first_then_the_largest() -> None:
    longest, second = LONGEST_FIRST[0], LONGEST_FIRST[1]
    items = [
        _Item("tests/unit/test_a.py::one", "tests/unit/test_a.py"),
        _Item(f"{second}::x", second),
        _Item("tests/unit/test_b.py::one", "tests/unit/test_b.py"),
        _Item("tests/unit/test_b.py::two", "tests/unit/test_b.py"),
        _Item(f"{longest}::y", longest),
        _Item(f"{longest}::z", longest),
    ]
    ordered = longest_first(cast(list[pytest.Item], items))
    assert [i.nodeid for i in ordered] == [
        f"{longest}::y",
        f"{longest}::z",
        f"{second}::x",
        "tests/unit/test_b.py::one",  # two tests before one
        "tests/unit/test_b.py::two",
        "tests/unit/test_a.py::one",
    ]


def test_every_group_named_longest_exists() -> None:
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    for group in LONGEST_FIRST:
        assert group == DEMO_GROUP or (ROOT / group).is_file(), group
