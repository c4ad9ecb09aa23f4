"""Our n-gram drafter vs transformers' own prompt lookup decoding vs plain decoding, tokens/s at T=0.

Prompt lookup decoding (`prompt_lookup_num_tokens` in `model.generate`) is the off-the-shelf way to get n-gram
speculation, so our engine with `NgramDrafter` has to beat it to be worth having; and since n-gram drafts often do
not pay on a CPU, it must also never make decoding noticeably slower than plain `model.generate`. Two checks:

    ngram speedup >= prompt-lookup speedup
    ngram speedup >= 0.97 (loses no more than 3 % to plain decoding)

where a speedup is total new tokens / total seconds of a method over the same for plain `model.generate`.

Per prompt the three methods run back to back in rotating order (each goes first in turn), after one warm-up run
of each, so the noise of a shared machine hits all alike; `--repeats R` runs that whole sweep R times (each with a
fresh `NgramDrafter`, whose learned statistics would otherwise carry over) and reports the median over the sweeps.
Target forwards are counted with a forward hook on the model, so every method's tokens per forward (acceptance
length, prefill included) is measured the same way. At T=0 all outputs must equal plain decoding's.

    .venv/bin/python benchmarks/ngram_vs_prompt_lookup.py [--dataset mt_bench] [--limit 8] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.config import EvalConfig
from draftsmith.data.sources import KNOWN_DATASETS, load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.evaluate import baseline_generate
from draftsmith.target import Target, load_target

REPO_ROOT = Path(__file__).resolve().parents[1]
PLAIN, LOOKUP, NGRAM = "plain generate", "prompt lookup", "ngram (ours)"
METHODS = (PLAIN, LOOKUP, NGRAM)
MIN_SPEEDUP = 0.97  # ngram may lose at most 3 % to plain decoding


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    forwards: int


class ForwardCounter:
    """Counts calls of the model's forward, whoever makes them (generate, assisted generation, our engine)."""

    def __init__(self, target: Target) -> None:
        self.calls = 0
        target.model.register_forward_hook(self._hook)

    def _hook(self, module: object, args: object, output: object) -> None:
        self.calls += 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="built-in name, HF directory or hub id")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--dataset", default="mt_bench", help=f"one of {', '.join(KNOWN_DATASETS)}, or a file")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("DRAFTSMITH_DATA") or REPO_ROOT.parent / "shared" / "data"),
        help="folder with the named datasets' files (default: $DRAFTSMITH_DATA, else ../shared/data from the repo)",
    )
    parser.add_argument("--limit", type=int, default=8, help="first N prompts (first turns only)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=7, help="our engine: most draft tokens per forward")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="transformers' prompt lookup")
    parser.add_argument("--repeats", type=int, default=1, help="run the whole interleaved sweep R times")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_methods(
    target: Target, args: argparse.Namespace, counter: ForwardCounter
) -> dict[str, Callable[[list[int]], Run]]:
    """One callable per method, prompt ids -> Run; the n-gram drafter is fresh for each call of this function."""
    cfg = EvalConfig(target=args.target, dtype=args.dtype, max_new_tokens=args.max_new_tokens, seed=args.seed)
    decoder = SpeculativeDecoder(target, NgramDrafter(), args.num_draft_tokens)

    def counted(fn: Callable[[list[int]], tuple[list[int], float]]) -> Callable[[list[int]], Run]:
        def run(ids: list[int]) -> Run:
            before = counter.calls
            tokens, seconds = fn(ids)
            return Run(tokens, seconds, counter.calls - before)

        return run

    def ngram(ids: list[int]) -> tuple[list[int], float]:
        gen = decoder.generate(ids, args.max_new_tokens, temperature=0.0, seed=args.seed)
        return gen.tokens, gen.seconds

    return {
        PLAIN: counted(lambda ids: baseline_generate(target, ids, cfg, args.seed)),
        LOOKUP: counted(
            lambda ids: baseline_generate(
                target, ids, cfg, args.seed, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens
            )
        ),
        NGRAM: counted(ngram),
    }


def sweep(
    target: Target, encoded: list[tuple[str, list[int]]], args: argparse.Namespace, counter: ForwardCounter, repeat: int
) -> dict[str, list[Run]]:
    """Every prompt once with every method, in an order that rotates from prompt to prompt."""
    methods = make_methods(target, args, counter)
    runs: dict[str, list[Run]] = {m: [] for m in METHODS}
    for i, (conv_id, ids) in enumerate(encoded):
        shift = (repeat * len(encoded) + i) % len(METHODS)
        for name in METHODS[shift:] + METHODS[:shift]:
            runs[name].append(methods[name](ids))
        plain = runs[PLAIN][-1]
        cells = [f"plain {len(plain.tokens) / plain.seconds:5.1f} tok/s"]
        for name in (LOOKUP, NGRAM):
            r = runs[name][-1]
            speedup = (len(r.tokens) / r.seconds) / (len(plain.tokens) / plain.seconds)
            same = "same" if r.tokens == plain.tokens else "DIFFERENT"
            cells.append(f"{name} {speedup:.2f}x {len(r.tokens) / r.forwards:.2f} tok/fwd {same}")
        print(f"  sweep {repeat + 1} prompt {conv_id:>6} ({len(ids)} tok): " + " | ".join(cells), flush=True)
    return runs


def total_tps(runs: list[Run]) -> float:
    return sum(len(r.tokens) for r in runs) / sum(r.seconds for r in runs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dataset, convs = load_eval_prompts(args.dataset, args.data_dir, args.limit)
    target = load_target(args.target, dtype=args.dtype)
    encoded = [(c.id, encode_chat(target.tokenizer, c.messages)) for c in convs]
    counter = ForwardCounter(target)
    n, r_count = len(encoded), args.repeats
    print(
        f"{target.name} ({args.dtype}), {dataset}: {n} prompts, {args.max_new_tokens} new tokens, T=0; "
        f"prompt lookup {args.prompt_lookup_num_tokens} tokens, ngram up to {args.num_draft_tokens} draft tokens; "
        f"{r_count} sweep(s), rotating order, 1 warm-up each",
        flush=True,
    )
    for run in make_methods(target, args, counter).values():  # warm-up, with a throwaway n-gram drafter
        run(encoded[0][1])

    sweeps = [sweep(target, encoded, args, counter, r) for r in range(r_count)]

    tps = {m: [total_tps(s[m]) for s in sweeps] for m in METHODS}
    total_ratio = {m: statistics.median(t / p for t, p in zip(tps[m], tps[PLAIN], strict=True)) for m in METHODS}
    per_prompt_ratio = {
        m: statistics.median(
            (len(r.tokens) / r.seconds) / (len(p.tokens) / p.seconds)
            for s in sweeps
            for r, p in zip(s[m], s[PLAIN], strict=True)
        )
        for m in METHODS
    }
    per_forward = {
        m: sum(len(r.tokens) for s in sweeps for r in s[m]) / sum(r.forwards for s in sweeps for r in s[m])
        for m in METHODS
    }
    mismatches = {
        m: sum(r.tokens != p.tokens for s in sweeps for r, p in zip(s[m], s[PLAIN], strict=True)) for m in METHODS
    }

    print()
    print(
        f"{'method':<16} {'tokens/s (total)':>16} {'speedup (total)':>15} {'speedup (median/prompt)':>23} "
        f"{'tokens/forward':>14} {'mismatches vs plain':>19}"
    )
    for m in METHODS:
        print(
            f"{m:<16} {statistics.median(tps[m]):>16.1f} {total_ratio[m]:>14.2f}x {per_prompt_ratio[m]:>22.2f}x "
            f"{per_forward[m]:>14.2f} {'-' if m == PLAIN else f'{mismatches[m]}/{n * r_count}':>19}"
        )
    print(
        f"(tokens/s and total speedup: median over {r_count} sweep(s) of {n} prompts each; median/prompt: median of "
        f"{n * r_count} per-prompt ratios; tokens/forward: all runs, prefill included)"
    )
    if r_count > 1:
        for m in (LOOKUP, NGRAM):
            per_sweep = ", ".join(f"{t / p:.3f}" for t, p in zip(tps[m], tps[PLAIN], strict=True))
            print(f"{m} total speedup per sweep: {per_sweep}")

    ngram, lookup = total_ratio[NGRAM], total_ratio[LOOKUP]
    print()
    print(f"{'PASS' if ngram >= lookup else 'FAIL'}: ngram speedup {ngram:.3f} >= prompt-lookup speedup {lookup:.3f}")
    print(
        f"{'PASS' if ngram >= MIN_SPEEDUP else 'FAIL'}: ngram loses no more than 3 % to plain decoding "
        f"(speedup {ngram:.3f} >= {MIN_SPEEDUP})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
