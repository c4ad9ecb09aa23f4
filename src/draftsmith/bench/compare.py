"""Two bench results side by side: B / A per concurrency level, e.g. with a drafter (B) over without (A).

Throughput ratios above 1 mean B is faster; latency ratios below 1 mean B is faster. Only concurrency levels
present in both runs are compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from draftsmith.errors import DraftsmithError

# (label, level key, sub-key or None)
RATIOS = [
    ("output tok/s", "output_tokens_per_s", None),
    ("TTFT p50", "ttft_ms", "p50"),
    ("TPOT p50", "tpot_ms", "p50"),
    ("e2e p50", "e2e_ms", "p50"),
    ("e2e p99", "e2e_ms", "p99"),
]


def load_result(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DraftsmithError(
            f"{path}: no such file", hint="pass the result.json that `draftsmith bench` wrote"
        ) from None
    except json.JSONDecodeError as exc:
        raise DraftsmithError(
            f"{path}: not valid JSON ({exc})", hint="pass a result.json from `draftsmith bench`"
        ) from None
    if not isinstance(result, dict) or not isinstance(result.get("levels"), list):
        raise DraftsmithError(
            f"{path}: expected a `draftsmith bench` result with a 'levels' list",
            hint="pass the result.json that `draftsmith bench` wrote",
        )
    return result


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per shared concurrency level: {concurrency, <label>: B/A or None}."""
    by_conc = {lv["concurrency"]: lv for lv in a["levels"]}
    rows = []
    for level_b in b["levels"]:
        level_a = by_conc.get(level_b["concurrency"])
        if level_a is None:
            continue
        row: dict[str, Any] = {"concurrency": level_b["concurrency"]}
        for label, key, sub in RATIOS:
            va, vb = _value(level_a, key, sub), _value(level_b, key, sub)
            row[label] = vb / va if va and vb is not None else None
        rows.append(row)
    if not rows:
        raise DraftsmithError(
            "the two results share no concurrency level",
            hint="run both benches with the same --concurrency list",
        )
    return rows


def print_comparison(rows: list[dict[str, Any]], name_a: str, name_b: str, console: Console | None = None) -> None:
    table = Table(title=f"B / A   (A = {name_a}, B = {name_b})")
    table.add_column("concurrency", justify="right")
    for label, *_ in RATIOS:
        table.add_column(label, justify="right")
    for row in rows:
        table.add_row(str(row["concurrency"]), *("-" if row[x] is None else f"{row[x]:.2f}x" for x, *_ in RATIOS))
    (console or Console()).print(table)


def _value(level: dict[str, Any], key: str, sub: str | None) -> float | None:
    value = level.get(key)
    if sub is not None:
        value = value.get(sub) if isinstance(value, dict) else None
    return value
