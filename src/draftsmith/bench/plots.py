"""Two PNGs per run: throughput vs concurrency, and latency percentiles vs concurrency (Agg backend, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.util import commit_file, temp_path


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    levels = result["levels"]
    conc = [lv["concurrency"] for lv in levels]
    title = f"{result['model']} ({result['endpoint']})"
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(conc, [lv["output_tokens_per_s"] for lv in levels], marker="o", label="aggregate")
    ax.plot(conc, [_get(lv, "request_tokens_per_s", "p50") for lv in levels], marker="s", label="per request (p50)")
    ax.set(xlabel="concurrency", ylabel="output tokens/s", title=f"throughput: {title}")
    paths.append(_save(fig, ax, conc, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("ttft_ms", "TTFT"), ("e2e_ms", "e2e"), ("tpot_ms", "TPOT")):
        for p, style in (("p50", "-"), ("p99", "--")):
            ax.plot(conc, [_get(lv, key, p) for lv in levels], style, marker="o", label=f"{label} {p}")
    ax.set(xlabel="concurrency", ylabel="ms", title=f"latency: {title}")
    ax.set_yscale("log")
    paths.append(_save(fig, ax, conc, out / "latency.png"))
    return paths


def _get(level: dict[str, Any], key: str, sub: str) -> float:
    value = (level.get(key) or {}).get(sub)
    return float("nan") if value is None else value


def _save(fig, ax, conc: list[int], path: Path) -> Path:
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path, ".png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    commit_file(tmp, path)
    return path
