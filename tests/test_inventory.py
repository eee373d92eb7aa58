"""The suite checks nothing less than before it was made faster
(tools/testing/test_inventory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ROOT

from tools.testing.test_inventory import inventory

BEFORE = ROOT / "docs" / "test_inventory_before.tsv"
"""The listing before the suite was made faster (d4dab9f)."""
BEFORE_LAYOUT = ROOT / "docs" / "test_inventory_48_before.tsv"
"""The listing before the house was re-laid (issue 48, at c5cd21b)."""


@pytest.mark.parametrize("before", [BEFORE, BEFORE_LAYOUT], ids=lambda p: p.stem)
def test_every_check_listed_before_is_still_made(before: Path) -> None:
    now = set(inventory(ROOT))
    missing = [line for line in before.read_text().splitlines() if line and line not in now]
    assert not missing, "\n".join(missing)


def test_the_listing_sees_the_chaos_tests_fault_points_and_kills() -> None:
    """The check above can fail: the listing finds what the chaos test arms and does."""
    from rftpipe.faults import FAULT_POINTS

    chaos = "tests/test_chaos.py::test_chaos_resume_is_bitwise_identical"
    lines = [line.split("\t") for line in inventory(ROOT)]
    armed = {value for kind, test, value in lines if kind == "fault" and test == chaos}
    assert armed >= set(FAULT_POINTS), set(FAULT_POINTS) - armed
    assert ["sigkill", chaos, "SIGKILL"] in lines
    assert any(kind == "bad_input" and "test_bad_input.py" in test for kind, test, _ in lines)
