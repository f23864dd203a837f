"""``--transfer-harness MODULE:NAME`` (tests/conftest.py): how the contract suite finds a
backend harness of one's own, and what it refuses."""

from __future__ import annotations

import pytest

from tests.transfer_harness import LocalHarness, load_harnesses

#: A list of harnesses, as a module may name one per pool layout.
HARNESSES = [LocalHarness()]
ONE = LocalHarness()
NOT_A_HARNESS = object()


def test_a_harness_or_a_list_of_them_is_loaded_by_module_and_name() -> None:
    listed = load_harnesses("tests.test_transfer_harness_option:HARNESSES")
    assert [(type(h).__name__, h.name) for h in listed] == [("LocalHarness", "local")]
    (one,) = load_harnesses("tests.test_transfer_harness_option:ONE")
    assert one.plays_decode and one.moves_data


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.test_transfer_harness_option", "expected MODULE:NAME"),
    (":HARNESSES", "expected MODULE:NAME"),
    ("tests.test_transfer_harness_option:NOT_A_HARNESS",
     "has no name, moves_data, plays_decode, marks, layout, make"),
])
def test_a_bad_spec_is_a_usage_error(spec: str, message: str) -> None:
    with pytest.raises(pytest.UsageError, match=message):
        load_harnesses(spec)
