"""Serving with and without a drafter: `draftsmith serve` twice, `draftsmith bench` across concurrency levels.

Acceptance length is not throughput: speculation that helps one stream can hurt a loaded server. This script
starts two servers on the same target, A without a drafter (`--drafter none`) and B with one (the n-gram drafter
by default, or a trained EAGLE-3 run directory), and loads both with the same streamed MT-bench requests at each
concurrency level. The levels run interleaved, A then B, then B then A at the next level, so the noise of a shared
machine hits both alike; both servers stay up throughout (an idle one only waits). It prints B / A per level and
writes each server's bench result (JSON, Markdown, PNGs) under --out.

    .venv/bin/python benchmarks/serve_sweep.py [--drafter ngram | RUN_DIR] [--concurrency 1,2,4,8]
        [--num-prompts 16] [--max-tokens 128] [--target smollm2-135m] [--data-dir ../shared/data]

Prompts are MT-bench's first turns from --data-dir or $DRAFTSMITH_DATA (the built-in prompts with --prompts
builtin). Each server decodes up to max(--concurrency) requests at once, interleaved round by round (see README:
the scheduler does not batch forwards across requests).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from draftsmith.bench.compare import compare, print_comparison
from draftsmith.bench.plots import write_plots
from draftsmith.bench.report import print_table, write_result
from draftsmith.bench.run import BenchConfig, run_bench
from draftsmith.serve.process import ServerProcess


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="built-in name, HF directory or hub id")
    parser.add_argument("--drafter", default="ngram", help="B's drafter: ngram, ngram:MIN-MAX or an EAGLE-3 run dir")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels")
    parser.add_argument("--prompts", default="mt_bench", help="mt_bench, builtin, or a prompt file")
    parser.add_argument("--data-dir", type=Path, default=None, help="folder with mt_bench_questions.jsonl")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per level and server")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per server (1 on a busy machine)")
    parser.add_argument("--out", type=Path, default=Path("runs/serve_sweep"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    levels = [int(c) for c in args.concurrency.split(",")]
    data_dir = args.data_dir or (Path(os.environ["DRAFTSMITH_DATA"]) if "DRAFTSMITH_DATA" in os.environ else None)
    common = ["--target", args.target, "--max-active", str(max(levels)), "--max-queue", str(4 * max(levels)),
              "--num-draft-tokens", str(args.num_draft_tokens), "--model-name", "target"]  # fmt: skip
    if args.threads:
        common += ["--threads", str(args.threads)]
    names = {"A": "none", "B": args.drafter}
    results: dict[str, dict] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        ServerProcess([*common, "--drafter", "none"], log=args.out / "server-A.log") as server_a,
        ServerProcess([*common, "--drafter", args.drafter], log=args.out / "server-B.log") as server_b,
    ):
        servers = {"A": server_a, "B": server_b}
        for i, concurrency in enumerate(levels):
            for key in "AB" if i % 2 == 0 else "BA":
                cfg = BenchConfig.checked(
                    url=servers[key].url, model="target", concurrency=[concurrency], prompts=args.prompts,
                    data_dir=data_dir, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                    out=args.out / key,
                )  # fmt: skip
                result = run_bench(cfg, log=lambda msg, k=key: console.print(f"[{k}: {names[k]}] {msg}"))
                if key in results:
                    results[key]["levels"] += result["levels"]
                else:
                    results[key] = result
    for key, result in results.items():
        result["drafter"] = names[key]
        write_result(result, args.out / key)
        write_plots(result, args.out / key)
        print_table(result, console)
    rows = compare(results["A"], results["B"])
    print_comparison(rows, f"--drafter none ({args.out / 'A'})", f"--drafter {args.drafter} ({args.out / 'B'})")
    for row in rows:
        server = next(lv["server"] for lv in results["B"]["levels"] if lv["concurrency"] == row["concurrency"])
        tau = f", tau {server['acceptance_length']:.2f}" if server and server.get("acceptance_length") else ""
        console.print(
            f"concurrency {row['concurrency']}: {names['B']} / none = {row['output tok/s']:.2f}x output tokens/s{tau}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
