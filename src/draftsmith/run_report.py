"""RUN_DIR/report.md of `draftsmith run`: stage times, the evaluation of every drafter with its plot, and (when
those stages ran) where the export is, what doctor found, and the load benchmark against the plain target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.util import write_atomic


def write_run_report(run_dir: Path, target: str, stage_status: dict[str, Any]) -> Path:
    """RUN_DIR/report.md: how long each stage took, the evaluation of every drafter, and the plots."""
    lines = [f"# draftsmith run: {target}", "", "| stage | seconds |", "| --- | ---: |"]
    lines += [f"| {s} | {e.get('seconds', 0):.0f} |" for s, e in stage_status.items() if e.get("state") == "completed"]
    total = sum(e.get("seconds", 0) for e in stage_status.values())
    lines += [f"| **total** | {total:.0f} |", ""]
    reports = _eval_reports(run_dir / "eval")
    if reports:
        first = reports[0]
        lines += [
            f"Evaluation on `{first['dataset']}`: {first['prompts']} prompts, {first['max_new_tokens']} new tokens, "
            f"T={first['temperature']}; baseline `model.generate` {first['baseline_tokens_per_s']:.1f} tokens/s.",
            "",
            "| drafter | acceptance length | speedup | tokens/s | mismatches |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for r in reports:
            tree = f" (tree {r['tree']})" if r.get("tree") else ""
            lines.append(
                f"| {r['drafter']}{tree} | {r['acceptance_length']:.2f} | {r['speedup']:.2f}x | "
                f"{r['spec_tokens_per_s']:.1f} | {r['mismatches']} |"
            )
            if r.get("acceptance_length_fixed") is not None:  # the learned drafter's own quality, beside its policy
                chain = len(r["acceptance_by_position_fixed"])  # a tree report's num_draft_tokens is the tree's total
                lines.append(
                    f"| its fixed chain of {chain} ({r.get('fixed_chain', 'timed')}) | "
                    f"{r['acceptance_length_fixed']:.2f} | {_or_dash(r.get('speedup_fixed'), '.2f', 'x')} | "
                    f"{_or_dash(r.get('spec_tokens_per_s_fixed'), '.1f')} | {_or_dash(r.get('mismatches_fixed'))} |"
                )
        plot = _plot_acceptance(reports, run_dir / "eval" / "acceptance.png")
        lines += ["", f"![acceptance by draft position]({plot.relative_to(run_dir)})"]
    if (run_dir / "train" / "curves.png").is_file():
        lines += ["", "![training curves](train/curves.png)"]
    lines += _shipping_lines(run_dir, stage_status)
    write_atomic(run_dir / "report.md", "\n".join(lines) + "\n")
    return run_dir / "report.md"


def _or_dash(value: float | None, spec: str = "", unit: str = "") -> str:
    """A table cell: the value formatted, or '-' where the run did not measure it (a replayed chain's speed)."""
    return "-" if value is None else format(value, spec) + unit


def _shipping_lines(run_dir: Path, stage_status: dict[str, Any]) -> list[str]:
    """Export, doctor and bench, each only when that stage completed in this run directory."""
    done = {s for s, e in stage_status.items() if e.get("state") == "completed"}
    lines: list[str] = []
    config = run_dir / "export" / "config.json"
    if "export" in done and config.is_file():
        fmt = (json.loads(config.read_text()).get("draftsmith") or {}).get("format", "?")
        lines += ["", f"Exported ({fmt}) to `export/`; serve it with the commands in `export/README.md`."]
    doctor = run_dir / "doctor" / "report.json"
    if "doctor" in done and doctor.is_file():
        checks = json.loads(doctor.read_text())["checks"]
        counts = {s: sum(c["status"] == s for c in checks) for s in ("PASS", "WARN", "FAIL", "SKIP")}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        bad = [f"{c['name']} ({c['status']})" for c in checks if c["status"] in ("WARN", "FAIL")]
        lines += ["", f"Doctor: {summary}{'; see ' + ', '.join(bad) if bad else ''} (`doctor/report.md`)."]
    result = run_dir / "bench" / "result.json"
    if "bench" in done and result.is_file():
        lines += ["", *_bench_lines(run_dir / "bench", json.loads(result.read_text()))]
    return lines


def _bench_lines(bench_dir: Path, result: dict) -> list[str]:
    ratios = {}
    if (bench_dir / "compare.json").is_file():
        ratios = {r["concurrency"]: r for r in json.loads((bench_dir / "compare.json").read_text())["rows"]}
    lines = [
        f"Load benchmark of `draftsmith serve` with the drafter ({result['endpoint']}, {result['num_requests']} "
        f"requests per level, {result['max_tokens']} max tokens, T={result['temperature']}):",
        "",
        "| concurrency | output tok/s | TTFT p50 ms | e2e p50 ms | tok/s vs no drafter |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for lv in result["levels"]:
        ratio = (ratios.get(lv["concurrency"]) or {}).get("output tok/s")
        lines.append(
            f"| {lv['concurrency']} | {lv['output_tokens_per_s']:.1f} | {_ms(lv['ttft_ms'])} | {_ms(lv['e2e_ms'])} | "
            f"{f'{ratio:.2f}x' if ratio else '-'} |"
        )
    return lines


def _ms(stats: dict) -> str:
    return "-" if stats.get("p50") is None else f"{stats['p50']:.0f}"


def _eval_reports(eval_dir: Path) -> list[dict]:
    files = [eval_dir / "report.json", *sorted(eval_dir.glob("*/report.json"))]
    return [json.loads(f.read_text()) for f in files if f.is_file()]


def _plot_acceptance(reports: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in reports:
        rates = r["acceptance_by_position"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{r['drafter']} (τ={r['acceptance_length']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | proposed)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
