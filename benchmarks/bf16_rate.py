"""Is bf16 worth it on this machine? A linear over a batch of rows in float32 and in bfloat16, interleaved.

The data, extract and train stages compute in bf16 only where `target.bf16_is_native` says the hardware does
(`dtype: auto`, `bf16: auto`): on an AMX Xeon a bf16 matmul runs several times faster than float32, on an AVX2 CPU
it is emulated and several times slower. This prints both rates, their ratio and what `auto` picks here; it always
exits 0. Measure on a quiet machine (`../shared/tools/quiet`).

    .venv/bin/python benchmarks/bf16_rate.py [--rows 128] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from draftsmith.target import bf16_is_native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="rows a forward multiplies (the cpu profiles' batch)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = (1536, 576)  # SmolLM2-135M's MLP projection
    tensors = {
        dtype: (torch.randn(args.rows, shape[1], dtype=dtype), torch.randn(*shape, dtype=dtype))
        for dtype in (torch.float32, torch.bfloat16)
    }
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in tensors}
    for x, w in tensors.values():
        F.linear(x, w)  # warm-up
    for _ in range(args.reps):
        for dtype, (x, w) in tensors.items():
            start = time.perf_counter()
            for _ in range(20):
                F.linear(x, w)
            times[dtype].append((time.perf_counter() - start) / 20)
    flops = 2 * args.rows * shape[0] * shape[1]
    rate = {dtype: flops / statistics.median(t) / 1e9 for dtype, t in times.items()}
    print(f"linear {args.rows} x {shape[1]} -> {shape[0]}, {args.threads} threads, median of {args.reps} x 20:")
    print(f"  float32 {rate[torch.float32]:.1f} GFLOP/s, bfloat16 {rate[torch.bfloat16]:.1f} GFLOP/s "
          f"(bf16 / float32 = {rate[torch.bfloat16] / rate[torch.float32]:.2f})")  # fmt: skip
    native = bf16_is_native("cpu")
    print(f"  bf16 native here: {native}; dtype auto computes in {'bfloat16' if native else 'float32'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
