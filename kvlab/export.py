"""Tables and records out of kvlab: the one CSV and JSON writer of pages, CLIs and reports.

A missing value (a failed run's cell) stays missing: an empty CSV cell and a JSON ``null``, never 0
and never ``NaN`` (which is not JSON).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd


def whole_numbers(column: str, largest: float) -> bool:
    """The one rule for how a table prints floats: whole with thousands separators for a time in ms or a number
    that 3 significant digits would print as a power of ten (5158 as 5.16e+03, 999.6 as 1e+03), else to 3 significant
    digits.

    ``largest``: the largest magnitude the column (or a lone cell) holds."""
    return "ms" in re.findall(r"[a-z]+", column.lower()) or largest >= 999.5


def without_quiet(df: pd.DataFrame, quiet: tuple[str, ...]) -> pd.DataFrame:
    """``df`` without those of its ``quiet`` columns no row says anything in (every cell empty, blank, "—" or
    False: no error, no query past the context): shown, a column of blanks reads as a broken one. Tables on the
    pages and in the reports drop them by this one rule; files keep every column."""
    def says(v: object) -> bool:
        return not pd.isna(v) and bool(v.strip() not in ("", "—") if isinstance(v, str) else v)

    said = {c: any(says(v) for v in df[c]) for c in quiet if c in df}
    return df.drop(columns=[c for c, anything in said.items() if not anything])


def records(df: pd.DataFrame) -> list[dict]:
    """Rows as dicts with None for missing values."""
    return df.astype(object).where(df.notna(), None).to_dict(orient="records")


def table_csv(df: pd.DataFrame) -> bytes:
    """A table as UTF-8 CSV, without the index; missing values are empty cells."""
    return df.to_csv(index=False).encode("utf-8")


def to_json(obj: object, indent: int | None = None) -> str:
    """JSON text of ``obj``: tables become records, numpy values plain numbers, NaN and infinities null.

    Anything else that JSON cannot hold raises TypeError rather than being written as text.
    """
    return json.dumps(_plain(obj), indent=indent, allow_nan=False)


def _plain(obj: object) -> object:
    """``obj`` with every value JSON can hold as it is (see ``to_json``)."""
    if isinstance(obj, pd.DataFrame):
        return [_plain(r) for r in records(obj)]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, pd.Series, np.ndarray)):
        return [_plain(v) for v in list(obj)]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj
