"""DFlash against EAGLE-3, trained from one store for the same wall-clock time, on the first MT-bench first turns.

Both drafters train from the same extract store (EAGLE-3 with its draft vocabulary, DFlash on the same layers) for
the same training time: a short probe times each algorithm's steps on this machine, then each trains fresh for as
many steps as fit `--minutes` (the table reports the seconds each really took). Then, per prompt, interleaved in a
rotating order after a warm-up, on the same packed target (T=0, `--max-new-tokens` new tokens):

    baseline     transformers `model.generate`: the speed-up's denominator
    none         the engine with no drafter (its own overhead)
    ngram        prompt-lookup n-gram drafting
    eagle3       EAGLE-3 with a fixed chain of its trained depth (tau with a fixed chain)
    eagle3-adaptive  the same drafter with the adaptive budget (the end-to-end number)
    dflash       DFlash with the full block (B-1 draft tokens every round)

and prints one table: tau (tokens per target forward), acceptance by draft position, draft cost per round (the
drafter's own seconds per verify round, also as a multiple of one plain decode step), speed-up over `generate`,
and mismatches against `generate` (must be 0). Time it only on a quiet machine (`../shared/tools/quiet`):

    DRAFTSMITH_DATA=../shared/data .venv/bin/python benchmarks/dflash_vs_eagle3.py \\
        --store runs/cmp/extract --vocab runs/cmp/vocab --minutes 30 [--prompts 40] [--out runs/dflash_vs_eagle3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from draftsmith.config import EvalConfig
from draftsmith.data.sources import load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters import NullDrafter
from draftsmith.drafters.base import Draft, Drafter
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.evaluate import baseline_generate
from draftsmith.formats.load import build_drafter
from draftsmith.stages import train
from draftsmith.target import load_target
from draftsmith.train.trainer import TrainConfig

COMMON = dict(batch_size=8, lr=1.0e-3, warmup_steps=30, max_length=512, eval_every=50, checkpoint_every=100)
EAGLE3 = COMMON | dict(algo="eagle3", ttt_steps=4, norm_before_fc=True, norm_before_residual=True)  # as eagle3.yaml
DFLASH = COMMON | dict(algo="dflash", block_size=8, draft_layers=2, anchors=16, draft_vocab=True)  # as cpu-full
PROBE_STEPS = 4


class TimedDrafter:
    """Any drafter, with the seconds its `propose` calls take (the draft cost of a round) added up."""

    def __init__(self, drafter: Drafter) -> None:
        self.inner, self.name, self.aux_layer_ids = drafter, drafter.name, drafter.aux_layer_ids
        self.seconds, self.rounds = 0.0, 0

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        self.inner.begin(prompt, features)

    def propose(self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator) -> Draft:
        start = time.perf_counter()
        draft = self.inner.propose(tokens, max_tokens, temperature, generator)
        self.seconds += time.perf_counter() - start
        self.rounds += 1
        return draft

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        start = time.perf_counter()
        self.inner.accepted(num_accepted, features)
        self.seconds += time.perf_counter() - start


def seconds_per_step(settings: dict, store: Path, vocab: Path, out: Path, target) -> float:
    """A short fresh run: the seconds of its last steps (the first pays one-time costs)."""
    start = time.perf_counter()
    train(TrainConfig.checked(**settings, max_steps=1, val_fraction=0), store, vocab, out, target, fresh=True)
    first = time.perf_counter()
    train(TrainConfig.checked(**settings, max_steps=1 + PROBE_STEPS, val_fraction=0), store, vocab, out, target)
    per_step = (time.perf_counter() - first) / PROBE_STEPS
    print(f"probe {settings['algo']}: first step {first - start:.1f}s, then {per_step:.2f}s a step", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return per_step


def train_for(settings: dict, minutes: float, store: Path, vocab: Path, out: Path, target) -> tuple[int, float]:
    steps = max(1, int(minutes * 60 / seconds_per_step(settings, store, vocab, out / "probe", target)))
    start = time.perf_counter()
    train(TrainConfig.checked(**settings, max_steps=steps), store, vocab, out, target, fresh=True)
    return steps, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--vocab", type=Path, required=True, help="EAGLE-3's draft vocabulary (`draftsmith vocab`)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--minutes", type=float, default=30.0, help="training wall-clock per algorithm")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("DRAFTSMITH_DATA", "../shared/data")))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-training", action="store_true", help="reuse OUT/eagle3 and OUT/dflash")
    parser.add_argument("--out", type=Path, default=Path("runs/dflash_vs_eagle3"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)

    budget = {}
    for name, settings in (("eagle3", EAGLE3), ("dflash", DFLASH)):
        if not args.skip_training:
            budget[name] = train_for(settings, args.minutes, args.store, args.vocab, args.out / name, target)
    eagle3 = build_drafter(str(args.out / "eagle3"), target, draft_length="fixed")
    adaptive = build_drafter(str(args.out / "eagle3"), target, draft_length="adaptive")
    adaptive.name = "eagle3-adaptive"
    dflash = build_drafter(f"dflash:{args.out / 'dflash'}", target)
    contestants = {
        "none": (NullDrafter(), 1),
        "ngram": (NgramDrafter(), 4),
        "eagle3": (eagle3, EAGLE3["ttt_steps"]),
        "eagle3-adaptive": (adaptive, EAGLE3["ttt_steps"]),
        "dflash": (dflash, DFLASH["block_size"] - 1),
    }
    timed = {name: TimedDrafter(d) for name, (d, _) in contestants.items()}
    decoders = {name: SpeculativeDecoder(target, timed[name], k) for name, (_, k) in contestants.items()}

    _, prompts = load_eval_prompts("mt_bench", args.data_dir, args.prompts)
    encoded = [encode_chat(target.tokenizer, c.messages) for c in prompts]
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, out=args.out)
    for decoder in decoders.values():  # warm-up
        decoder.generate(encoded[0], 16)
    baseline_generate(target, encoded[0], cfg.model_copy(update={"max_new_tokens": 16}), 0)
    for t in timed.values():
        t.seconds, t.rounds = 0.0, 0

    order = ["baseline", *decoders]
    stats = {n: {"tokens": 0, "forwards": 0, "seconds": 0.0, "mismatches": 0, "proposed": [], "accepted": []}
             for n in order}  # fmt: skip
    for i, ids in enumerate(encoded):
        shift = i % len(order)
        runs = {}
        for name in order[shift:] + order[:shift]:
            if name == "baseline":
                runs[name] = baseline_generate(target, ids, cfg, 0)
            else:
                runs[name] = decoders[name].generate(ids, args.max_new_tokens)
        truth, base_seconds = runs["baseline"]
        stats["baseline"]["tokens"] += len(truth)
        stats["baseline"]["seconds"] += base_seconds
        for name in decoders:
            out, s = runs[name], stats[name]
            s["tokens"] += len(out.tokens)
            s["forwards"] += out.target_forwards
            s["seconds"] += out.seconds
            s["mismatches"] += out.tokens != truth
            s["proposed"] = [a + b for a, b in zip(s["proposed"] or [0] * len(out.proposed), out.proposed, strict=True)]
            s["accepted"] = [a + b for a, b in zip(s["accepted"] or [0] * len(out.accepted), out.accepted, strict=True)]
        print(f"prompt {i + 1}/{len(encoded)} done", flush=True)

    base_tps = stats["baseline"]["tokens"] / stats["baseline"]["seconds"]
    step_seconds = 1 / base_tps  # one plain decode step
    rows = []
    for name in decoders:
        s, t = stats[name], timed[name]
        steps, seconds = budget.get(name.removesuffix("-adaptive"), (None, None))
        by_position = [a / p if p else 0.0 for a, p in zip(s["accepted"], s["proposed"], strict=True)]
        draft_cost = t.seconds / t.rounds if t.rounds else 0.0
        rows.append({
            "drafter": name,
            "draft_tokens": contestants[name][1],
            "tau": s["tokens"] / s["forwards"],
            "acceptance_by_position": by_position,
            "draft_seconds_per_round": draft_cost,
            "draft_cost_in_decode_steps": draft_cost / step_seconds,
            "speedup": (s["tokens"] / s["seconds"]) / base_tps,
            "mismatches": s["mismatches"],
            "training": {"steps": steps, "seconds": seconds},
        })  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps({"baseline_tokens_per_s": base_tps, "rows": rows}, indent=2))
    print(f"\n{len(encoded)} MT-bench first turns, T=0, {args.max_new_tokens} new tokens, {args.threads} threads; "
          f"baseline `generate` {base_tps:.1f} tok/s; training budget {args.minutes:g} min per algorithm")  # fmt: skip
    print("| drafter | draft tokens | trained (steps, s) | tau | acceptance by position | draft cost / round "
          "| speed-up | mismatches |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        trained = r["training"]
        when = f"{trained['steps']}, {trained['seconds']:.0f}" if trained["steps"] else "-"
        accs = " / ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        print(f"| {r['drafter']} | {r['draft_tokens']} | {when} | {r['tau']:.2f} | {accs} | "
              f"{1000 * r['draft_seconds_per_round']:.1f} ms ({r['draft_cost_in_decode_steps']:.2f} steps) | "
              f"{r['speedup']:.2f}x | {r['mismatches']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
