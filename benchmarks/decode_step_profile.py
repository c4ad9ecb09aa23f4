"""Where a batched decode step of the data stage goes: the step time, written tokens/s and the top ops by self CPU
time (`torch.profiler`), for `BatchDecoder` on synthetic prompts of one length.

Why: regeneration is compared against the prefill rate (`data_throughput.py`); this shows what a decode step
spends beyond what a prefilled token costs (the LM head over the whole vocabulary, attention over the KV cache).
Prints a measurement and always exits 0; measure on a quiet machine (`../shared/tools/quiet`).

    .venv/bin/python benchmarks/decode_step_profile.py [--batch-size 128] [--prompt-length 120] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from draftsmith.backends.batch import BatchDecoder, batched_attention
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(args.prompt_length)] for i in range(args.batch_size)]
    with torch.inference_mode(), batched_attention(target.model):
        decoder = BatchDecoder(target, prompts, args.steps + args.profiled_steps + 1)
        tokens, seconds = decoder.logits.argmax(-1), []
        for _ in range(args.steps):
            began = time.perf_counter()
            tokens = decoder.step(tokens).argmax(-1)
            seconds.append(time.perf_counter() - began)
        step = statistics.median(seconds)
        rate = args.batch_size / step
        print(f"{target.name} ({args.dtype}), batch {args.batch_size}, prompts of {args.prompt_length} tokens: "
              f"decode step median {step * 1e3:.1f} ms over {args.steps} steps = {rate:.0f} written tok/s")  # fmt: skip
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled_steps):
                tokens = decoder.step(tokens).argmax(-1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
