"""Where a batched decode step of the data stage goes: the step time, written tokens/s and the top ops by self CPU
time (`torch.profiler`), for `BatchDecoder` on synthetic prompts of one length.

Why: regeneration is compared against the prefill rate (`data_throughput.py`); this shows what a decode step
spends beyond what a prefilled token costs (the LM head over the whole vocabulary, attention over the KV cache).

`--attention kernel,torch` times each way of computing a bf16 decode step's attention (the native kernel of
`kernels/decode_attention.cpp`, or torch's batched matmuls), interleaved: each of `--repeats` rounds decodes the
same prompts once per arm, from a fresh cache; medians and their ratio are printed. The profile follows, of the
first arm. Prints a measurement and always exits 0; measure on a quiet machine (`../shared/tools/quiet`).

    .venv/bin/python benchmarks/decode_step_profile.py [--batch-size 128] [--prompt-length 120] [--steps 64]
        [--attention kernel,torch] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from draftsmith import attention as attention_module
from draftsmith.backends.batch import BatchDecoder, batched_attention, choose
from draftsmith.target import load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--prompt-length", type=int, default=120)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--profiled-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention", default="kernel", help="comma-separated arms: kernel, torch")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of every arm")
    args = parser.parse_args(argv)
    arms = args.attention.split(",")
    if not set(arms) <= set(ATTENTION):
        parser.error(f"--attention takes {', '.join(ATTENTION)}")
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(args.prompt_length)] for i in range(args.batch_size)]
    steps: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm in arms:
            with attention(arm):
                steps[arm].append(statistics.median(time_steps(target, prompts, args.steps)))
    print(f"{target.name} ({args.dtype}), batch {args.batch_size}, prompts of {args.prompt_length} tokens, "
          f"{args.steps} steps from a fresh cache, medians of {args.repeats} interleaved rounds:")  # fmt: skip
    median = {arm: statistics.median(times) for arm, times in steps.items()}
    for arm in arms:
        print(f"  attention {arm}: decode step {median[arm] * 1e3:.1f} ms = {args.batch_size / median[arm]:.0f} tok/s")
    if len(arms) > 1:
        print(f"  step time {arms[0]} / {arms[1]}: {median[arms[0]] / median[arms[1]]:.3f}")
    with attention(arms[0]), torch.inference_mode(), batched_attention(target.model):
        decoder = BatchDecoder(target, prompts, args.profiled_steps + 1)
        tokens = choose(decoder.logits, 0.0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled_steps):
                tokens = choose(decoder.step(tokens), 0.0)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


ATTENTION = ("kernel", "torch")


@contextmanager
def attention(arm: str):
    """`torch`: bf16 decode attention by torch's batched matmuls (the native kernel switched off for the block)."""
    saved = attention_module.LOW_PRECISION
    attention_module.LOW_PRECISION = attention_module.LOW_PRECISION if arm == "kernel" else ()
    try:
        yield
    finally:
        attention_module.LOW_PRECISION = saved


def time_steps(target, prompts: list[list[int]], n: int) -> list[float]:
    """Seconds of each of `n` greedy decode steps after a prefill, as the data stage runs them."""
    seconds = []
    with torch.inference_mode(), batched_attention(target.model):
        decoder = BatchDecoder(target, prompts, n + 1)
        tokens = choose(decoder.logits, 0.0)
        for _ in range(n):
            began = time.perf_counter()
            tokens = choose(decoder.step(tokens), 0.0)
            seconds.append(time.perf_counter() - began)
    return seconds


if __name__ == "__main__":
    raise SystemExit(main())
