"""Drafter precision: an EAGLE-3 drafter's step, and its speculative decoding, with float32 vs int8 weights.

A draft step is a handful of one-row matmuls over the drafter's weights (~26 MB in float32 for SmolLM2's layer and
a 4096-token head), so on a CPU it is bound by the bytes it reads; `packed.Int8Linear` reads a quarter of them.
Two measurements in one run:

- step: one draft step over a `--context`-position cache, with the linears plain (`F.linear`), packed for oneDNN
  (the float32 drafter) and int8; interleaved, medians of `--reps` rounds of 30 steps.
- decode (with `--prompts N`): the first N prompts of `--dataset`, greedy, a fixed chain of `--num-draft-tokens`:
  plain decoding (`model.generate`), the float32 drafter and the int8 drafter, interleaved per prompt (the order
  rotates) after one warm-up each; τ, tokens/s, speedups and the paired int8/float32 ratio; both outputs must equal
  plain decoding's. int8 moves what the drafter proposes (a 1-2 % error in its logits), never the output.

Measure on a quiet machine (`../shared/tools/quiet`). The script prints a measurement and always exits 0.

    .venv/bin/python benchmarks/drafter_step.py --drafter runs/demo/train [--prompts 20] [--dataset mt_bench]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from draftsmith.config import EvalConfig
from draftsmith.data.sources import load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.eagle3 import Eagle3Drafter, Eagle3Model, KVCache
from draftsmith.evaluate import baseline_generate
from draftsmith.formats.load import build_model, read_drafter
from draftsmith.packed import pack_linears, quantize_linears
from draftsmith.target import load_target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", required=True, help="an EAGLE-3 run or checkpoint directory")
    parser.add_argument("--context", type=int, default=200, help="positions in the drafter's cache for a step")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=0, help="also decode the first N prompts (0: steps only)")
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def step_fn(model: Eagle3Model, context: int) -> Callable[[], torch.Tensor]:
    """One draft step over a `context`-position cache (cropped back after each), returning its draft logits."""
    h = model.config.hidden_size
    x = torch.randn(1, context + 1, h, generator=torch.Generator().manual_seed(0))
    cache = KVCache()
    with torch.inference_mode():
        model.forward_hidden(x[:, :context], x[:, :context], torch.arange(context), cache)
    position = torch.tensor([context])

    def step() -> torch.Tensor:
        with torch.inference_mode():
            _, logits = model(x[:, context:], x[:, context:], position, cache)
        cache.crop(context)
        return logits

    return step


def time_steps(model: Eagle3Model, args: argparse.Namespace) -> None:
    layouts = {"plain": copy.deepcopy(model), "packed": copy.deepcopy(model), "int8": copy.deepcopy(model)}
    pack_linears(layouts["packed"])
    quantize_linears(layouts["int8"])
    steps = {name: step_fn(m, args.context) for name, m in layouts.items()}
    ref = steps["plain"]()
    for step in steps.values():
        for _ in range(10):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.reps):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(30):
                step()
            times[name].append((time.perf_counter() - start) / 30 * 1e3)
    plain = statistics.median(times["plain"])
    print(f"draft step, cache of {args.context}, {args.threads} threads (median of {args.reps} x 30 steps):")
    for name, step in steps.items():
        err = float((step() - ref).norm() / ref.norm())
        ms = statistics.median(times[name])
        print(f"  {name:>6}: {ms:.3f} ms  ({plain / ms:.2f}x plain)  logits relative error {err:.4f}")


def time_decoding(model: Eagle3Model, target, args: argparse.Namespace) -> None:
    dataset, convs = load_eval_prompts(args.dataset, args.data_dir, args.prompts)
    encoded = [encode_chat(target.tokenizer, c.messages) for c in convs]
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens)
    k, n_new = args.num_draft_tokens, args.max_new_tokens
    decoders = {
        precision: SpeculativeDecoder(target, Eagle3Drafter(copy.deepcopy(model), precision=precision), k)
        for precision in ("float32", "int8")
    }
    runs = {name: [] for name in ("plain", *decoders)}  # (tokens, seconds, target forwards)

    def run(name: str, ids: list[int]) -> tuple[list[int], float, int]:
        if name == "plain":
            tokens, seconds = baseline_generate(target, ids, cfg, 0)
            return tokens, seconds, len(tokens)
        gen = decoders[name].generate(ids, n_new)
        return gen.tokens, gen.seconds, gen.target_forwards

    names = list(runs)
    for name in names:  # warm-up
        run(name, encoded[0])
    for i, ids in enumerate(encoded):
        for name in names[i % 3 :] + names[: i % 3]:
            runs[name].append(run(name, ids))
    plain = runs["plain"]
    plain_tps = sum(len(t) for t, _, _ in plain) / sum(s for _, s, _ in plain)
    print(f"\n{dataset}: {len(encoded)} prompts, {n_new} new tokens, greedy, fixed chain of {k}, interleaved:")
    print(f"  plain decoding: {plain_tps:.1f} tok/s")
    for name in decoders:
        got = runs[name]
        tps = sum(len(t) for t, _, _ in got) / sum(s for _, s, _ in got)
        tau = sum(len(t) for t, _, _ in got) / sum(f for _, _, f in got)
        same = sum(a[0] == b[0] for a, b in zip(got, plain, strict=True))
        print(f"  {name:>7} drafter: τ {tau:.2f}, {tps:.1f} tok/s, {tps / plain_tps:.2f}x; identical {same}/{len(got)}")
    ratios = [(len(a[0]) / a[1]) / (len(b[0]) / b[1]) for a, b in zip(runs["int8"], runs["float32"], strict=True)]
    print(f"  int8 / float32 tokens/s: median paired ratio {statistics.median(ratios):.3f} over {len(ratios)} prompts")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    with torch.no_grad():  # the drafter as trained, its linears plain (`load_drafter` would pack them)
        model = build_model(read_drafter(args.drafter, target.num_layers, target), target).eval()
    time_steps(model, args)
    if args.prompts:
        time_decoding(model, target, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
