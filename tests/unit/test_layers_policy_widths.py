"""Width resolution of the resizable policies: pure, no process group."""

from __future__ import annotations

import pytest

from colossal_hetero.policies.widths import even_widths, resolve_widths

TOTALS = {"heads": 6, "ffn": 64, "vocab": 256}


def test_even_widths_spread_the_remainder_first():
    assert even_widths(10, 3) == (4, 3, 3)
    assert even_widths(6, 2, unit=2) == (4, 2)
    assert even_widths(0, 2) == (0, 0)


def test_missing_keys_are_split_evenly_and_given_ones_kept():
    widths = resolve_widths({"heads": [5, 1]}, TOTALS, 2)
    assert widths == {"heads": (5, 1), "ffn": (32, 32), "vocab": (128, 128)}


@pytest.mark.parametrize(
    ("widths", "message"),
    [
        ({"heads": [5, 2]}, "sums to 7, the model has 6"),
        ({"heads": [6]}, "one entry per TP rank"),
        ({"heads": [6, 0]}, "at least 1"),
        ({"heads": [3, 3]}, "multiple of 2"),
        ({"experts": [1, 1]}, "unknown keys"),
    ],
)
def test_bad_widths_name_the_key(widths, message):
    with pytest.raises(ValueError, match=message):
        resolve_widths(widths, TOTALS, 2, units={"heads": 2}, min_width={"heads": 1})


def test_zero_widths_allowed_where_no_minimum():
    assert resolve_widths({"ffn": [0, 64]}, TOTALS, 2)["ffn"] == (0, 64)
