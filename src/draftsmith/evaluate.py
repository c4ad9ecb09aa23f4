"""Measure a drafter: acceptance length, per-position acceptance and wall-clock speedup over `model.generate`.

Every prompt runs twice, speculative and autoregressive baseline, interleaved (alternating which goes first) after
one warm-up, so machine noise hits both alike. At T=0 the two outputs must be identical token for token; any
prompt where they differ is counted in `mismatches`.
"""

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers import GenerationConfig

from draftsmith.config import EvalConfig
from draftsmith.data.sources import Conversation
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import Generation, SpeculativeDecoder
from draftsmith.drafters.base import Drafter
from draftsmith.progress import progress_bar
from draftsmith.target import Target
from draftsmith.util import write_atomic


def baseline_generate(
    target: Target, prompt_ids: list[int], cfg: EvalConfig, seed: int, **generate_kwargs: Any
) -> tuple[list[int], float]:
    """Plain autoregressive decoding with transformers' own `generate`, same model and settings.

    `generate_kwargs` go into the `GenerationConfig` (e.g. `prompt_lookup_num_tokens=10` for transformers' own
    prompt lookup decoding); without them this is plain decoding.
    """
    sampling = cfg.temperature > 0
    gen_cfg = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sampling,
        temperature=cfg.temperature if sampling else None,
        top_p=cfg.top_p if sampling else None,
        top_k=None,
        eos_token_id=sorted(target.eos_token_ids),
        pad_token_id=target.tokenizer.pad_token_id or min(target.eos_token_ids),
        **generate_kwargs,
    )
    ids = torch.tensor([prompt_ids], device=target.device)
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    seconds = time.perf_counter() - start
    tokens = out[0, len(prompt_ids) :].tolist()
    return tokens[: _end(tokens, target.eos_token_ids)], seconds


def _end(tokens: list[int], eos: set[int]) -> int:
    """Length up to and including the first EOS (generate pads after it)."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def evaluate(target: Target, drafter: Drafter, dataset: str, prompts: list[Conversation], cfg: EvalConfig) -> dict:
    return evaluate_drafters(target, [drafter], dataset, prompts, cfg)[0]


def evaluate_drafters(
    target: Target,
    drafters: Sequence[Drafter],
    dataset: str,
    prompts: list[Conversation],
    cfg: EvalConfig,
    everywhere: int = 1,
    draft_tokens: Sequence[int] | None = None,
    replayed: Drafter | None = None,
) -> list[dict]:
    """One report per drafter, all against the same baseline runs: per prompt, the baseline and each drafter run
    back to back in an order that rotates from prompt to prompt, so machine noise hits every contestant alike.
    The first `everywhere` drafters run on every prompt; the others on the first `cfg.compare_limit` prompts only
    (all when None), against the baseline runs of those prompts. `draft_tokens`: each drafter's most draft tokens
    per round (a tree's total), default `cfg.num_draft_tokens`. `replayed` (T=0): one more report, last, for a
    drafter replayed along the baselines' text instead of run (`replayed_report`)."""
    encoded = [encode_chat(target.tokenizer, c.messages) for c in prompts]
    for conv, ids in zip(prompts, encoded, strict=True):
        target.check_fits(len(ids), cfg.max_new_tokens, where=f"prompt {conv.id!r} of {dataset}")
    draft_tokens = list(draft_tokens or [cfg.num_draft_tokens] * len(drafters))
    decoders = [SpeculativeDecoder(target, d, k) for d, k in zip(drafters, draft_tokens, strict=True)]
    warm = min(16, cfg.max_new_tokens)
    for decoder in decoders:
        decoder.generate(encoded[0], warm, cfg.temperature, cfg.top_p, cfg.seed)
    baseline_generate(target, encoded[0], cfg.model_copy(update={"max_new_tokens": warm}), cfg.seed)

    specs: list[list[Generation]] = [[] for _ in decoders]
    baselines: list[tuple[list[int], float]] = []
    names = ", ".join(d.name for d in drafters)
    with progress_bar(transient=True) as progress:
        task = progress.add_task(f"eval {names} on {dataset}", total=len(prompts))
        for i, ids in enumerate(encoded):
            seed = cfg.seed + i
            contestants = [-1] + [c for c in range(len(decoders)) if c < everywhere or i < _compared(cfg, len(prompts))]
            shift = i % len(contestants)
            for c in contestants[shift:] + contestants[:shift]:
                if c < 0:
                    baselines.append(baseline_generate(target, ids, cfg, seed))
                else:
                    specs[c].append(decoders[c].generate(ids, cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed))
            progress.advance(task)
    reports = [
        _summarise(
            target,
            d,
            dataset,
            prompts[: len(runs)],
            cfg.model_copy(update={"num_draft_tokens": k}),
            [(s, *b) for s, b in zip(runs, baselines[: len(runs)], strict=True)],
        )  # fmt: skip
        for d, k, runs in zip(drafters, draft_tokens, specs, strict=True)
    ]
    if replayed is not None:
        reports.append(replayed_report(target, replayed, prompts, encoded, [text for text, _ in baselines], cfg))
    return reports


def replayed_report(
    target: Target,
    drafter: Drafter,
    prompts: list[Conversation],
    encoded: list[list[int]],
    texts: list[list[int]],
    cfg: EvalConfig,
) -> dict:
    """A drafter's acceptance at T=0 without running it in the engine: each round replayed along the baseline's
    greedy text (`tune.replay`; the output is that text whatever the drafts), for the cost of one target forward
    per prompt instead of a decode. The speed fields are None: nothing was timed."""
    from draftsmith.tune import along, replay

    k = cfg.num_draft_tokens
    proposed, accepted, counts = [0] * k, [0] * k, []
    for ids, text in zip(encoded, texts, strict=True):
        sizes, paths, _ = replay(drafter, along(target, drafter, ids, text, cfg.max_new_tokens), k)
        for size, path in zip(sizes, paths, strict=True):
            proposed[:size] = [n + 1 for n in proposed[:size]]
            accepted[: len(path)] = [n + 1 for n in accepted[: len(path)]]
        counts.append((len(text), 1 + len(paths)))  # the prefill's forward writes the first token
    return {
        "acceptance_length": sum(t for t, _ in counts) / sum(f for _, f in counts),
        "acceptance_by_position": [a / p if p else 0.0 for a, p in zip(accepted, proposed, strict=True)],
        "drafts_by_position": proposed,
        "spec_tokens_per_s": None,
        "speedup": None,
        "mismatches": None,
        "by_kind": _by_kind(prompts, counts),
    }


def _compared(cfg: EvalConfig, n: int) -> int:
    return n if cfg.compare_limit is None else min(n, cfg.compare_limit)


def _summarise(target, drafter, dataset, prompts, cfg: EvalConfig, runs) -> dict:
    proposed = [sum(r[0].proposed[i] for r in runs) for i in range(cfg.num_draft_tokens)]
    accepted = [sum(r[0].accepted[i] for r in runs) for i in range(cfg.num_draft_tokens)]
    new_tokens = sum(len(s.tokens) for s, _, _ in runs)
    forwards = sum(s.target_forwards for s, _, _ in runs)
    spec_tps = new_tokens / sum(s.seconds for s, _, _ in runs)
    base_tps = sum(len(b) for _, b, _ in runs) / sum(t for _, _, t in runs)
    return {
        "target": target.name,
        "drafter": drafter.name,
        "dataset": dataset,
        "prompts": len(runs),
        "max_new_tokens": cfg.max_new_tokens,
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "num_draft_tokens": cfg.num_draft_tokens,
        "seed": cfg.seed,
        "acceptance_length": new_tokens / forwards,
        "acceptance_by_position": [a / p if p else 0.0 for a, p in zip(accepted, proposed, strict=True)],
        "drafts_by_position": proposed,
        "spec_tokens_per_s": spec_tps,
        "baseline_tokens_per_s": base_tps,
        "speedup": spec_tps / base_tps,
        "mismatches": sum(s.tokens != b for s, b, _ in runs) if cfg.temperature == 0 else None,
        "by_kind": _by_kind(prompts, [(len(s.tokens), s.target_forwards) for s, _, _ in runs]),
        "per_prompt": [
            {
                "id": conv.id,
                "kind": conv.kind,
                "new_tokens": len(s.tokens),
                "acceptance_length": s.acceptance_length,
                "spec_seconds": s.seconds,
                "baseline_seconds": t,
                "identical": s.tokens == b,
            }
            for conv, (s, b, t) in zip(prompts, runs, strict=True)
        ],
    }


FIXED_KEYS = ("acceptance_length", "acceptance_by_position", "drafts_by_position", "spec_tokens_per_s", "speedup",
              "mismatches", "by_kind")  # fmt: skip


def merge_fixed(report: dict, fixed: dict, suffix: str = "_fixed") -> dict:
    """The adaptive report with the same drafter's fixed-chain run added as `<key>_fixed`: the drafter's quality
    (what papers, vLLM and SGLang report) next to what the adaptive budget makes of it end to end. A tree report
    takes its drafter's chain runs the same way: `<key>_fixed`, and `<key>_adaptive` or `<key>_merged`."""
    return report | {f"{key}{suffix}": fixed[key] for key in FIXED_KEYS}


def _by_kind(prompts: list[Conversation], counts: list[tuple[int, int]]) -> dict[str, dict]:
    """Acceptance length per kind of prompt (MT-bench category, ...), from each prompt's (new tokens, target
    forwards): where a drafter carries and where not."""
    kinds: dict[str, list[tuple[int, int]]] = {}
    for conv, count in zip(prompts, counts, strict=True):
        kinds.setdefault(conv.kind or "unknown", []).append(count)
    return {
        kind: {"prompts": len(group), "acceptance_length": sum(t for t, _ in group) / sum(f for _, f in group)}
        for kind, group in sorted(kinds.items())
    }


SUMMARY_ROWS = [
    ("prompts", "prompts", "{}"),
    ("new tokens", "new_tokens", "{}"),
    ("target forwards", "target_forwards", "{}"),
    ("acceptance length (tokens/forward)", "acceptance_length", "{:.2f}"),
    ("speculative tokens/s", "spec_tokens_per_s", "{:.1f}"),
    ("baseline tokens/s (model.generate)", "baseline_tokens_per_s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("mismatches vs baseline", "mismatches", "{}"),
]
FIXED_ROWS = [
    ("fixed chain: acceptance length", "acceptance_length_fixed", "{:.2f}"),
    ("fixed chain: speculative tokens/s", "spec_tokens_per_s_fixed", "{:.1f}"),
    ("fixed chain: speedup", "speedup_fixed", "{:.2f}x"),
    ("fixed chain: mismatches vs baseline", "mismatches_fixed", "{}"),
]


PREDICTED_ROWS = [
    (f"tune predicted: {title}{what}", f"predicted_{key}{suffix}", fmt)
    for suffix, title in (("", ""), ("_fixed", "fixed chain: "), ("_merged", "merged chain: "))
    for what, key, fmt in (("speculative tokens/s", "tokens_per_s", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"))
]
# A tree's other runs beside its fixed chain (`_fixed`): its drafter's adaptive or merged chain.
TWIN_TITLES = {"_adaptive": "adaptive chain", "_merged": "merged chain"}


def summary_rows(report: dict) -> list[tuple[str, str]]:
    rows = list(SUMMARY_ROWS)
    if "acceptance_length_fixed" in report:
        rows += FIXED_ROWS
    for suffix, title in TWIN_TITLES.items():
        if f"acceptance_length{suffix}" in report:
            rows += [(f"{title}: {label.split(': ')[1]}", key.replace("_fixed", suffix), fmt)
                     for label, key, fmt in FIXED_ROWS]  # fmt: skip
    rows += [(label, key, fmt) for label, key, fmt in PREDICTED_ROWS if key in report]
    engine = report.get("engine")  # another engine's baseline is that engine without the drafter
    return [
        (label.replace("model.generate", f"plain {engine}") if engine else label, _shown(fmt, report[key]))
        for label, key, fmt in rows
    ]


def _shown(fmt: str, value: Any) -> str:
    """A summary value; None (a replayed run's speed, a sampled run's mismatches) as not measured."""
    return "-" if value is None else fmt.format(value)


def render_markdown(report: dict) -> str:
    lines = [
        f"# draftsmith eval: {report['drafter']} on {report['target']}",
        "",
        f"Dataset `{report['dataset']}`, {report['max_new_tokens']} new tokens max, "
        f"T={report['temperature']}, up to {report['num_draft_tokens']} draft tokens"
        + (f", drafter weights in {report['drafter_precision']}." if report.get("drafter_precision") else "."),
        "",
        "| metric | value |",
        "| --- | ---: |",
    ]
    lines += [f"| {label} | {value} |" for label, value in summary_rows(report)]
    if costs := report.get("draft_costs"):
        forwards = ", ".join(f"{c:.2f}" for c in costs["forward_costs"])
        lines += ["", f"Draft budget's costs timed here, in plain decode steps: a target forward over 1, 2, ... new "
                  f"tokens {forwards}; a drafter step {costs['step_cost']:.3f}."]  # fmt: skip
    first = "merged" if "+" in report["drafter"] else "adaptive budget"
    first = f"tree {report['tree']}" if report.get("tree") else first
    for suffix, title in [("", first), ("_fixed", "fixed chain"), *TWIN_TITLES.items()]:
        if f"acceptance_by_position{suffix}" not in report:
            continue
        lines += ["", f"| draft position ({title}) | P(accepted) | drafts |", "| ---: | ---: | ---: |"]
        lines += [
            f"| {i + 1} | {p:.3f} | {n} |"
            for i, (p, n) in enumerate(
                zip(report[f"acceptance_by_position{suffix}"], report[f"drafts_by_position{suffix}"], strict=True)
            )
        ]
    if len(report["by_kind"]) > 1:
        fixed = report.get("by_kind_fixed", {})
        lines += ["", "| kind | prompts | acceptance length | fixed chain |", "| --- | ---: | ---: | ---: |"]
        lines += [
            f"| {kind} | {row['prompts']} | {row['acceptance_length']:.2f} | "
            + (f"{fixed[kind]['acceptance_length']:.2f} |" if kind in fixed else "- |")
            for kind, row in report["by_kind"].items()
        ]
    return "\n".join(lines) + "\n"


def print_report(report: dict, console: Console | None = None) -> None:
    table = Table(title=f"{report['drafter']} on {report['target']} ({report['dataset']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in summary_rows(report):
        table.add_row(label, value)
    (console or Console()).print(table)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    write_atomic(out / "report.md", render_markdown(report))
