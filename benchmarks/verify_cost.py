"""What a verify forward costs: target forward time by the number of new tokens, for each linear-layer layout.

The draft budget (`drafters/budget.py`) needs the cost of a forward over the last token + k drafts relative to a
one-token forward (a plain decode step). On a CPU the target is memory-bound, so in theory k extra rows are nearly
free; `F.linear` re-packing its weights for every multi-row call made them cost ~1.8-2x (measured here).
`packed.py` lays them out once, per row count for the fastest kernel. The arms:
- `plain`: `nn.Linear` everywhere (`F.linear`);
- `torch`: packed, choosing per row count between torch's own kernels only (`F.linear` and oneDNN's packed one);
- `packed`: what draftsmith serves with: also draftsmith's row kernel (`kernels/rows.cpp`) where it is faster.

All run interleaved, on a KV cache of `--context` tokens, each forward cropped off again; medians over `--reps`
rounds. `--bf16` adds a bfloat16 copy of the target (plain layers): on an AMX CPU its multi-row forwards are nearly
flat, but its verify rounds differently from its one-token decode, so eval and serve stay float32. The script
prints a measurement and always exits 0.

    .venv/bin/python benchmarks/verify_cost.py [--context 200] [--reps 9] [--bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith.decode.cache import rollback
from draftsmith.packed import PackedLinear, kernel_by_rows
from draftsmith.target import Target, load_target

NEW_TOKENS = (1, 2, 3, 4, 6, 8, 16, 32)


def timed_forward(target: Target, cache, context: int, new: int) -> float:
    ids = torch.randint(0, target.vocab_size, (new,))
    start = time.perf_counter()
    target.forward(ids, cache, (2, target.num_layers // 2, target.num_layers - 3))
    seconds = time.perf_counter() - start
    rollback(cache, context)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the KV cache")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="add a bfloat16 target column")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    targets = {"plain": load_target(args.target, packed=False), "torch": load_target(args.target)}
    torch_kernels = kernel_by_rows(("linear", "onednn"))
    for layer in targets["torch"].model.modules():
        if isinstance(layer, PackedLinear):
            layer.kernels = torch_kernels
    targets["packed"] = load_target(args.target)
    if args.bf16:
        targets["bf16"] = load_target(args.target, dtype="bfloat16", packed=False)
    prompt = torch.randint(0, targets["plain"].vocab_size, (args.context,))
    caches = {}
    for name, target in targets.items():
        caches[name] = target.new_cache()
        target.forward(prompt, caches[name], logits_to_keep=1)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.reps):
        for name, target in targets.items():
            for new in NEW_TOKENS:
                times.setdefault((name, new), []).append(timed_forward(target, caches[name], args.context, new))
    median = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    print(f"target forward on a {args.context}-token cache, {args.threads} threads, median of {args.reps} interleaved")
    print(f"kernel by input rows (packed): {kernel_by_rows()}")
    print("new tokens | " + " | ".join(f"{name} ms | {name} / its 1-token" for name in targets) + " | torch / packed")
    for new in NEW_TOKENS:
        cells = [f"{median[name, new]:.1f} | {median[name, new] / median[name, 1]:.2f}" for name in targets]
        print(f"{new:10d} | " + " | ".join(cells) + f" | {median['torch', new] / median['packed', new]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
