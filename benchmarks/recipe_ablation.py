"""Which training recipe makes the best EAGLE-3 drafter: one change at a time, from one fixed store, same steps.

Every variant trains from the same extract store and draft vocabulary for the same number of steps (and the same
seed, so the same batches), starting from the base recipe with one setting changed. It prints, per variant, the
validation top-1 per draft step (full vocabulary, what greedy verification accepts), the validation chain length
(`chain_length`: the validation replies' teacher-forced tau_fixed), and tau_fixed: tokens per target forward with
a fixed chain of `--chain` on the first `--prompts` MT-bench first turns, T=0, 128 new tokens — replayed along
the target's greedy replies exactly as the engine accepts, so it is the drafter's real quality on prompts it did
not train on. Nothing is timed: the numbers do not depend on the machine's load.

    .venv/bin/python benchmarks/recipe_ablation.py --store runs/abl/extract --vocab runs/abl/vocab \\
        [--steps 100] [--variants base,head:freeze_lm_head=false,...] [--out runs/ablation]

A variant is `name` (the base recipe) or `name:key=value,key=value` with keys of `draftsmith train`'s settings.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import yaml

from draftsmith.config import EvalConfig
from draftsmith.data.sources import load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.base import NullDrafter
from draftsmith.evaluate import replayed_report
from draftsmith.formats.load import build_drafter
from draftsmith.stages import train
from draftsmith.target import load_target
from draftsmith.train.trainer import TrainConfig

BASE = dict(batch_size=8, lr=1.0e-3, warmup_steps=10, ttt_steps=4, max_length=512, eval_every=50, checkpoint_every=50)
VARIANTS = (
    "base",
    "logit-lens-init:init=logit_lens",
    "all-positions:all_positions=true",
    "trained-head:freeze_lm_head=false",
    "muon:optimizer=muon",
    "norms-on:norm_before_fc=true,norm_before_residual=true,norm_output=true",
    "ttt-3:ttt_steps=3",
    "feature-noise:feature_noise=0.05",
    "weight-decay:weight_decay=0.01",
    "mlp-4x:intermediate_size=6144",  # SmolLM2's MLP is 1,536 wide
)


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, settings = text.partition(":")
    changes = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        changes[key] = yaml.safe_load(value)
    return name, changes


def greedy_texts(target, encoded: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy replies, decoded once for every variant (at T=0 the output does not depend on drafts)."""
    decoder = SpeculativeDecoder(target, NullDrafter(), 1)
    return [decoder.generate(ids, max_new_tokens).tokens for ids in encoded]


def tau_fixed(run_dir: Path, target, prompts, encoded, texts, chain: int, max_new_tokens: int):
    """Tokens per target forward with a fixed chain, and acceptance by position, over the prompts: each round
    replayed along the greedy replies (`evaluate.replayed_report`, which accepts exactly what the engine does at
    T=0: tests/test_eval.py), so a variant costs one target forward per prompt, not a decode."""
    drafter = build_drafter(str(run_dir), target, draft_length="fixed")
    cfg = EvalConfig(num_draft_tokens=chain, max_new_tokens=max_new_tokens)
    report = replayed_report(target, drafter, prompts, encoded, texts, cfg)
    return report["acceptance_length"], report["acceptance_by_position"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--vocab", type=Path, required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated variants (see the docstring)")
    parser.add_argument("--set", action="append", default=[], help="base recipe override key=value (repeatable)")
    parser.add_argument("--chain", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("DRAFTSMITH_DATA", "../shared/data")))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/ablation"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    _, prompts = load_eval_prompts("mt_bench", args.data_dir, args.prompts)
    encoded = [encode_chat(target.tokenizer, conv.messages) for conv in prompts]
    texts = greedy_texts(target, encoded, args.max_new_tokens)
    base = BASE | {"max_steps": args.steps} | parse_variant("base:" + ",".join(args.set))[1]
    rows = []
    for text in args.variants.split(";"):
        name, changes = parse_variant(text)
        cfg = TrainConfig.checked(**(base | changes))
        result = train(cfg, args.store, args.vocab, args.out / name, target, fresh=True)
        tau, by_position = tau_fixed(args.out / name, target, prompts, encoded, texts, args.chain, args.max_new_tokens)
        val = result.val or {}
        best = max((r for r in _val_rows(args.out / name)), key=lambda r: r["chain_length"], default=val)
        row = {
            "variant": name,
            "changes": changes,
            "val_acc": [best.get(f"acc_{k}", 0.0) for k in range(cfg.ttt_steps)],
            "val_chain_length": best.get("chain_length", 0.0),
            "tau_fixed": tau,
            "acceptance_by_position_fixed": by_position,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "ablation.json").write_text(json.dumps({"base": base, "rows": rows}, indent=2) + "\n")
    print(
        f"\n{args.steps} steps x batch {base['batch_size']} from {args.store}; tau_fixed: chain of {args.chain}, "
        f"first {len(prompts)} MT-bench first turns, T=0, {args.max_new_tokens} new tokens; val = best checkpoint"
    )
    print("| variant | change | val top-1 per step | val chain length | tau_fixed |")
    print("| --- | --- | --- | ---: | ---: |")
    for r in rows:
        changes = ", ".join(f"{k}={v}" for k, v in r["changes"].items()) or "-"
        accs = " / ".join(f"{a:.3f}" for a in r["val_acc"])
        print(f"| {r['variant']} | {changes} | {accs} | {r['val_chain_length']:.2f} | {r['tau_fixed']:.2f} |")
    return 0


def _val_rows(run_dir: Path) -> list[dict]:
    from draftsmith.train.metrics import read_metrics

    return [r for r in read_metrics(run_dir) if r["split"] == "val"]


if __name__ == "__main__":
    raise SystemExit(main())
