"""llama-server's time per round by draft length: what `--spec-draft-n-max` / `-n-min` should be for a drafter.

A round is one target verify forward plus the drafter's k draft steps; plain decoding is a round with k = 0. One
plain llama-server and one per chain length k = 1..N (drafter GGUF, `--spec-draft-n-min k --spec-draft-p-min 0`: a
fixed chain of k) all run at once on the same target GGUF, idle but one; every prompt goes to each of them in an
order that rotates from prompt to prompt, after a warm-up request each. From llama.cpp's own per-request timings:

    ms/round  = predicted_ms / (predicted_n - 1 - draft_n_accepted)   (the prefill yields the first token)
    τ         = predicted_n / (predicted_n - draft_n_accepted)
    tok/s     = llama.cpp's predicted tokens / predicted seconds, and speedup = tok/s over the plain server's

The cost model behind `--spec-draft-n-max`: round(k) ≈ verify(k + 1 tokens) + k · draft step, and a chain of k pays
when τ(k) · plain ms/token > round(k). The table gives both factors, so a drafter with another acceptance can be
judged without re-running. Run it on a quiet machine; it prints a measurement and exits 0.

    .venv/bin/python benchmarks/llamacpp_draft_cost.py --drafter runs/x/gguf/drafter.gguf [--gguf-target f32]
        [--max-k 6] [--prompts 10] [--max-new-tokens 128] [--threads 2] [--draft-threads 2,1]
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

from draftsmith.data.sources import load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.engines.llama_server import Completion, Draft, LlamaServer
from draftsmith.engines.llamacpp import installed
from draftsmith.formats.gguf import served_target
from draftsmith.target import load_target


def row(runs: list[Completion]) -> dict[str, float]:
    tokens = sum(int(r.timings.get("predicted_n", 0)) for r in runs)
    accepted = sum(int(r.timings.get("draft_n_accepted", 0)) for r in runs)
    drafted = sum(int(r.timings.get("draft_n", 0)) for r in runs)
    ms = sum(float(r.timings.get("predicted_ms", 0.0)) for r in runs)
    rounds = tokens - len(runs) - accepted
    return {
        "ms_per_round": ms / max(rounds, 1),
        "tau": tokens / max(tokens - accepted, 1),
        "acceptance": accepted / drafted if drafted else 0.0,
        "tok_s": 1000.0 * tokens / ms if ms else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="drafter GGUF (`draftsmith export --format gguf`)")
    parser.add_argument("--target", default="smollm2-135m", help="draftsmith target (renders the prompts)")
    parser.add_argument("--gguf-target", default="f32", help="f32 | bf16 | q8_0 | q4_1 | FILE.gguf")
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-threads", default="", help="comma list, e.g. 2,1: a row per k per drafter thread "
                        "count (default: llama.cpp's, the target's --threads)")  # fmt: skip
    args = parser.parse_args()

    lc = installed()
    target = load_target(args.target, packed=False)
    _, convs = load_eval_prompts(args.dataset, None, args.prompts)
    prompts = [encode_chat(target.tokenizer, c.messages) for c in convs]
    gguf = served_target(args.target, args.gguf_target)
    ctx = max(len(p) for p in prompts) + args.max_new_tokens + 64
    thread_counts = [int(t) for t in args.draft_threads.split(",") if t] or [None]
    drafts: dict[tuple[int, int | None], Draft | None] = {(0, None): None}
    for k in range(1, args.max_k + 1):
        for td in thread_counts:
            drafts[k, td] = Draft(args.drafter, k, n_min=k, p_min=0.0, threads=td)
    runs: dict[tuple[int, int | None], list[Completion]] = {key: [] for key in drafts}
    with ExitStack() as stack:
        servers = {key: stack.enter_context(LlamaServer(lc, gguf, d, args.threads, ctx)) for key, d in drafts.items()}
        for server in servers.values():
            server.complete(prompts[0], 16)
        order = list(servers)
        for i, ids in enumerate(prompts):
            shift = i % len(order)
            for key in order[shift:] + order[:shift]:
                runs[key].append(servers[key].complete(ids, args.max_new_tokens, seed=i))
    plain = row(runs[0, None])
    print(f"llama-server, target {gguf.name}, drafter {args.drafter}, {len(prompts)} prompts of {args.dataset}, "
          f"{args.max_new_tokens} tokens, {args.threads} threads")  # fmt: skip
    header = ("k", 3), ("td", 3), ("ms/round", 9), ("round/plain", 11), ("tau", 6), ("accept", 7), ("tok/s", 7)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'speedup':>8}")
    best = (0, None)
    for key in drafts:
        r = row(runs[key])
        speedup = r["tok_s"] / plain["tok_s"] if plain["tok_s"] else 0.0
        k, td = key
        print(f"{k:>3} {td or '-':>3} {r['ms_per_round']:>9.2f} {r['ms_per_round'] / plain['ms_per_round']:>11.2f} "
              f"{r['tau']:>6.2f} {r['acceptance']:>7.3f} {r['tok_s']:>7.1f} {speedup:>7.2f}x")  # fmt: skip
        if r["tok_s"] > row(runs[best])["tok_s"]:
            best = key
    if best[0] == 0:
        print("no chain length beats plain llama-server: do not serve this drafter with this target")
    else:
        k, td = best
        threads = f" --spec-draft-threads {td}" if td else ""
        print(f"fastest: --spec-draft-n-max {k} --spec-draft-n-min {k} --spec-draft-p-min 0{threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
