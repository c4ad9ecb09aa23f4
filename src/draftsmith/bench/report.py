"""A bench result as files: result.json (everything, per request too), result.md (one row per level), and a table
on the console."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from draftsmith.util import write_atomic

# (column, level key, sub-key or None, format)
COLUMNS = [
    ("concurrency", "concurrency", None, "{}"),
    ("ok / sent", None, None, ""),
    ("output tok/s", "output_tokens_per_s", None, "{:.1f}"),
    ("req/s", "requests_per_s", None, "{:.2f}"),
    ("TTFT p50 ms", "ttft_ms", "p50", "{:.0f}"),
    ("TTFT p99 ms", "ttft_ms", "p99", "{:.0f}"),
    ("ITL p50 ms", "itl_ms", "p50", "{:.1f}"),
    ("TPOT p50 ms", "tpot_ms", "p50", "{:.1f}"),
    ("e2e p50 ms", "e2e_ms", "p50", "{:.0f}"),
    ("e2e p90 ms", "e2e_ms", "p90", "{:.0f}"),
    ("e2e p99 ms", "e2e_ms", "p99", "{:.0f}"),
    ("tok/s per request p50", "request_tokens_per_s", "p50", "{:.1f}"),
    ("server tokens", "server", "generation_tokens", "{}"),
    ("tau", "server", "acceptance_length", "{:.2f}"),
]


# The console shows the columns that fit in 100 characters; result.md has them all.
CONSOLE = ("concurrency", "ok / sent", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "e2e p50 ms", "e2e p99 ms", "tau")


def cells(level: dict[str, Any], columns: list[tuple] = COLUMNS) -> list[str]:
    out = []
    for _, key, sub, fmt in columns:
        if key is None:
            out.append(f"{level['completed']} / {level['requests']}")
            continue
        value = level.get(key)
        if sub is not None:
            value = value.get(sub) if isinstance(value, dict) else None
        out.append("-" if value is None else fmt.format(value))
    return out


def render_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# draftsmith bench: {result['model']} at {result['url']}",
        "",
        f"{result['endpoint']} endpoint, prompts `{result['prompts']}`, {result['num_requests']} streamed requests "
        f"per level, max_tokens {result['max_tokens']}, temperature {result['temperature']}. TTFT: time to the "
        "first content; ITL: time between content chunks; TPOT: (e2e - TTFT) / (tokens - 1) per request; "
        "server tokens and tau (tokens per target forward) come from the server's /metrics when it has them.",
        "",
        "| " + " | ".join(c[0] for c in COLUMNS) + " |",
        "| " + " | ".join("---:" for _ in COLUMNS) + " |",
    ]
    lines += ["| " + " | ".join(cells(level)) + " |" for level in result["levels"]]
    errors = [(lv["concurrency"], msg, n) for lv in result["levels"] for msg, n in lv["error_messages"].items()]
    if errors:
        lines += ["", "Errors:", ""] + [f"- concurrency {c}: {n} x {msg}" for c, msg, n in errors]
    return "\n".join(lines) + "\n"


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    table = Table(title=f"{result['model']} at {result['url']}")
    columns = [c for c in COLUMNS if c[0] in CONSOLE]
    for name, *_ in columns:
        table.add_column(name, justify="right")
    for level in result["levels"]:
        table.add_row(*cells(level, columns))
    (console or Console()).print(table)


def write_result(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "result.json", json.dumps(result, indent=2) + "\n")
    write_atomic(out / "result.md", render_markdown(result))
