"""Engine overhead: our decode loop with a drafter that proposes nothing vs transformers' `model.generate`.

With `NullDrafter` every engine step is exactly one target forward over one token, i.e. plain greedy decoding, so
any gap in tokens/s against `model.generate` (same model, same prompts, same settings) is the cost of the engine's
own bookkeeping: drafting calls, verification, cache handling, Python per step. That is the floor every speculative
speedup has to pay for, and the target is an overhead under 10 %.

The two run interleaved per prompt (alternating which goes first) after one warm-up of each, so the noise of a
shared machine hits both alike. Greedy outputs must be identical token for token. The script reports a measurement
and always exits 0; read the PASS/FAIL line.

    .venv/bin/python benchmarks/engine_overhead.py [--limit 8] [--max-new-tokens 128] [--dataset builtin]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from draftsmith.config import EvalConfig
from draftsmith.data.sources import KNOWN_DATASETS, load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.base import NullDrafter
from draftsmith.evaluate import baseline_generate
from draftsmith.target import load_target

MAX_OVERHEAD = 0.10  # the target: the engine may be at most 10 % slower than model.generate


@dataclass
class Timed:
    tokens: list[int]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="built-in name, HF directory or hub id")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--dataset", default="builtin", help=f"one of {', '.join(KNOWN_DATASETS)}, or a file")
    parser.add_argument("--data-dir", type=Path, default=None, help="folder with the named datasets' files")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dataset, convs = load_eval_prompts(args.dataset, args.data_dir, args.limit)
    target = load_target(args.target, dtype=args.dtype)
    encoded = [encode_chat(target.tokenizer, c.messages) for c in convs]
    cfg = EvalConfig(target=args.target, dtype=args.dtype, max_new_tokens=args.max_new_tokens, seed=args.seed)
    decoder = SpeculativeDecoder(target, NullDrafter(), num_draft_tokens=1)

    def engine(ids: list[int]) -> Timed:
        gen = decoder.generate(ids, args.max_new_tokens, temperature=0.0, seed=args.seed)
        return Timed(gen.tokens, gen.seconds)

    def generate(ids: list[int]) -> Timed:
        return Timed(*baseline_generate(target, ids, cfg, args.seed))

    print(
        f"{target.name} ({args.dtype}), {dataset}: {len(encoded)} prompts, {args.max_new_tokens} new tokens, greedy; "
        "engine+NullDrafter vs model.generate, interleaved, 1 warm-up each",
        flush=True,
    )
    engine(encoded[0])
    generate(encoded[0])

    header = f"{'prompt':>8} {'prompt tok':>10} {'new tok':>7} {'engine tok/s':>12} {'generate tok/s':>14} "
    print(header + f"{'ratio':>6} {'identical':>9}", flush=True)
    runs: list[tuple[Timed, Timed]] = []
    for i, (conv, ids) in enumerate(zip(convs, encoded, strict=True)):
        if i % 2:
            gen = generate(ids)
            eng = engine(ids)
        else:
            eng = engine(ids)
            gen = generate(ids)
        runs.append((eng, gen))
        print(
            f"{conv.id:>8} {len(ids):>10} {len(eng.tokens):>7} {eng.tokens_per_s:>12.1f} {gen.tokens_per_s:>14.1f} "
            f"{eng.tokens_per_s / gen.tokens_per_s:>6.3f} {'yes' if eng.tokens == gen.tokens else 'NO':>9}",
            flush=True,
        )

    n = len(runs)
    median_ratio = statistics.median(e.tokens_per_s / g.tokens_per_s for e, g in runs)
    engine_tps = sum(len(e.tokens) for e, _ in runs) / sum(e.seconds for e, _ in runs)
    generate_tps = sum(len(g.tokens) for _, g in runs) / sum(g.seconds for _, g in runs)
    total_ratio = engine_tps / generate_tps
    identical = sum(e.tokens == g.tokens for e, g in runs)

    print()
    print(f"total tokens/s: engine {engine_tps:.1f}, generate {generate_tps:.1f}  ({n} prompts, 1 run each)")
    print(f"engine/generate ratio: median per-prompt {median_ratio:.3f} (of {n}), total {total_ratio:.3f}")
    print(f"engine overhead = 1 - ratio: {1 - median_ratio:+.1%} (median per-prompt), {1 - total_ratio:+.1%} (total)")
    print(f"identical outputs: {identical}/{n}" + ("" if identical == n else "  <-- MISMATCH: engine is not lossless"))
    overhead = 1 - total_ratio
    verdict = "PASS" if overhead < MAX_OVERHEAD else "FAIL"
    print(f"{verdict}: engine overhead {overhead:.1%} (total ratio, {n} prompts) vs target < {MAX_OVERHEAD:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
