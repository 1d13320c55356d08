"""What the terminal shows of results: tables with numbers to a fixed number of digits and every empty cell as "-",
and a replay's check against its file."""

from __future__ import annotations

import re
import sys

import pandas as pd

from kvlab.saved import ReplayCheck

COUNTS = re.compile(r"(tokens|blocks|position|turn)$")  # columns of whole numbers, float only where a cell is empty


def text_table(table: pd.DataFrame, digits: int = 3) -> str:
    """``table`` as aligned text without its index: floats to ``digits`` places, counts whole; NaN, None and
    pandas' <NA> all read "-", so an empty cell never looks like a value (or like Python's ``None``)."""
    table = table.astype({c: "Int64" for c in table.columns if COUNTS.search(str(c))
                          and pd.api.types.is_float_dtype(table[c]) and table[c].dropna().mod(1).eq(0).all()})
    shown = table.astype({c: object for c in table.columns if not pd.api.types.is_float_dtype(table[c])})
    for col in shown.select_dtypes("object"):
        shown[col] = shown[col].where(shown[col].notna(), "-")
    return shown.to_string(index=False, float_format=lambda v: f"{v:.{digits}f}", na_rep="-")


def print_replay(check: ReplayCheck, path: str) -> bool:
    """Say whether a replay matched its file ``path`` (stdout) or where it differs (stderr); True when it differs."""
    headline = check.headline(path)
    if check.identical:
        print(headline)
        return False
    print(f"kvlab: error: {headline[0].lower()}{headline[1:]}:", file=sys.stderr)
    for line in check.found:
        print(f"  {line}", file=sys.stderr)
    return True
