"""`draftsmith tune`: which draft tree (or chain) decodes fastest on this machine, and how to serve it.

    tokens/s(shape) = new tokens / (prefill + sum over rounds of (verify(m + 1) + draft(shape) + engine))

- verify(n): the target's forward over n new tokens on a warm cache, under the tree mask as the engine runs it
  (with the mask built and the cache compacted), timed here for n = 1..64 (17 sizes, the rest interpolated),
  interleaved, medians;
- draft(shape): the drafter's own `propose` for that shape, timed inside the acceptance run below (it includes
  the drafter's catch-up over the positions the target just confirmed, which depends on how many it accepts);
- engine: the engine's remaining per-round work, from a plain-decoding run against its forwards;
- acceptance: at T=0 the output is the target's greedy text whatever the drafts, so every shape is replayed over
  that text: per round the drafter proposes from the confirmed prefix, the accepted path is the longest one the
  text continues, and the drafter is handed the target's features of that path. The target runs once per prompt,
  the drafter once per round and shape, so dozens of shapes cost about what one eval of one shape would.

The table of every shape, the best one, and the matching SGLang and vLLM flags are printed and written to
`tune.json`, which `eval` / `serve --tree FILE` read (`--tree auto` runs a short tune first).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from draftsmith.decode import tree
from draftsmith.decode.cache import compact, rollback
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.tree import TreeShape
from draftsmith.drafters.base import Drafter, NullDrafter
from draftsmith.errors import ConfigError
from draftsmith.target import Target
from draftsmith.util import write_atomic

MAX_VERIFY = 64
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64)  # timed; the rest interpolated
# (depths, top-ks, totals, chain lengths) tried by default. Short chains and trees of 4 nodes are in it because a
# forward over 2-5 rows can cost no more than a one-token forward on a CPU (packed.py); deeper than 6 was never
# chosen by the drafters measured (P(the accepted path reaches depth 5) < 0.03).
DEFAULT_GRID = ((3, 4, 6), (2, 4, 8), (4, 8, 16, 32), (1, 2, 3, 4, 5, 6, 8))


@dataclass
class ShapeResult:
    shape: str  # "depth=D,topk=K,total=N"; topk=1 is a chain of D tokens
    depth: int
    topk: int
    total: int
    acceptance_length: float  # new tokens per target forward, prefill included (as eval reports it)
    tokens_per_s: float  # predicted
    draft_ms: float  # mean drafter time per round
    verify_ms: float  # mean target verify time per round (from the table)
    accepted_by_depth: list[float] = field(default_factory=list)  # P(the path reaches depth d+1)
    rank_tree: list[tuple[int, ...]] = field(default_factory=list)  # the static tree vLLM would serve instead


def verify_costs(target: Target, context: int = 200, sizes: Sequence[int] = VERIFY_SIZES, repeats: int = 5):
    """Seconds per target forward over n = 1..64 new tokens on a `context`-long cache: n = 1 as plain decoding runs
    it, n > 1 as a tree of n - 1 nodes (mask built, cache compacted). `sizes` are timed (medians of interleaved
    runs), the sizes between them interpolated linearly."""
    cache = target.new_cache()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context + MAX_VERIFY,), generator=gen)
    with torch.inference_mode():
        target.forward(prompt[:context], cache, logits_to_keep=1)

    def run(n: int) -> None:
        if n == 1:
            target.forward(prompt[context : context + 1], cache)
            rollback(cache, context)
            return
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n - 1)], dtype=torch.long)  # a binary tree
        target.forward(
            prompt[context : context + n],
            cache,
            attention_mask=tree.verify_mask(parents, context, torch.float32),
            position_ids=tree.verify_positions(parents, context),
        )
        compact(cache, context + 1, [context + 1 + i for i in (0, 2) if i < n - 1])  # a path: nodes 0 and 2
        rollback(cache, context)

    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        for n in sizes:
            run(n)  # warm-up
        for _ in range(repeats):
            for n in sizes:
                start = time.perf_counter()
                run(n)
                times[n].append(time.perf_counter() - start)
    measured = sorted((n, statistics.median(ts)) for n, ts in times.items())
    costs = {}
    for (lo, a), (hi, b) in zip(measured, measured[1:], strict=False):
        for n in range(lo, hi + 1):
            costs[n] = a + (b - a) * (n - lo) / (hi - lo)
    return costs or dict(measured)


def engine_overhead(target: Target, prompt_ids: list[int], one_token: float, new_tokens: int = 32) -> float:
    """Seconds per round the engine spends outside the target's forwards (plain decoding through the engine)."""
    decoder = SpeculativeDecoder(target, NullDrafter(), 1)
    decoder.generate(prompt_ids, 4)
    runs = []
    for _ in range(3):
        cache = target.new_cache()
        start = time.perf_counter()
        with torch.inference_mode():
            target.forward(torch.tensor(prompt_ids), cache, logits_to_keep=1)
        prefill = time.perf_counter() - start
        gen = decoder.generate(prompt_ids, new_tokens)
        runs.append((gen.seconds - prefill) / max(1, len(gen.tokens) - 1) - one_token)
    return max(0.0, statistics.median(runs))


@dataclass
class Replay:
    """One prompt's greedy text and the target's features along it: what every shape is replayed against."""

    prompt: torch.Tensor
    text: list[int]  # the new tokens
    features: torch.Tensor | None  # (prompt + new, aux width)
    prefill_s: float
    max_new_tokens: int  # the decode's budget: the engine drafts up to it even where the text ends (EOS) sooner


def record(target: Target, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int) -> Replay:
    """Decode `prompt_ids` greedily and time its prefill alone (tune's cost model counts it once per prompt)."""
    out = SpeculativeDecoder(target, NullDrafter(), 1).generate(prompt_ids, max_new_tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        target.forward(torch.tensor(prompt_ids), target.new_cache(), logits_to_keep=1)
    return along(target, drafter, prompt_ids, out.tokens, max_new_tokens, time.perf_counter() - start)


def along(
    target: Target,
    drafter: Drafter,
    prompt_ids: list[int],
    text: list[int],
    max_new_tokens: int,
    prefill_s: float = 0.0,
) -> Replay:
    """The replay of a greedy `text` already decoded after `prompt_ids`: one target forward for the features."""
    features = None
    if drafter.aux_layer_ids:
        with torch.inference_mode():
            full = torch.tensor(prompt_ids + text)
            features = target.forward(full, target.new_cache(), drafter.aux_layer_ids, logits_to_keep=1).aux_hidden
    return Replay(torch.tensor(prompt_ids), text, features, prefill_s, max_new_tokens)


def replay(drafter: Drafter, run: Replay, max_tokens: int) -> tuple[list[int], list[tuple[int, ...]], float]:
    """Decode `run` again with `drafter` at T=0, without the target, as the engine would: (tree size per round,
    accepted path per round as sibling ranks, drafter seconds in all)."""
    p, text = len(run.prompt), run.text
    seq = torch.cat([run.prompt, torch.tensor(text, dtype=torch.long)])
    feats = run.features
    drafter.begin(run.prompt, None if feats is None else feats[:p])
    n, sizes, paths, seconds = p + 1, [], [], 0.0
    gen = torch.Generator().manual_seed(0)
    while n < len(seq):
        k = min(max_tokens, run.max_new_tokens - (n - p) - 1)
        ranks: tuple[int, ...] = ()
        sizes.append(0)
        if k > 0:
            start = time.perf_counter()
            draft = drafter.propose(seq[:n], k, 0.0, gen)
            seconds += time.perf_counter() - start
            parents = draft.parents if draft.parents is not None else torch.arange(len(draft.tokens)) - 1
            kids, toks, row = tree.children(parents), draft.tokens.tolist(), 0
            while n + len(ranks) < len(seq):
                hit = next((j for j, c in enumerate(kids[row]) if toks[c] == int(seq[n + len(ranks)])), None)
                if hit is None:
                    break
                row = kids[row][hit] + 1
                ranks = (*ranks, hit)
            sizes[-1] = len(toks)
            drafter.accepted(len(ranks), None if feats is None else feats[n - 1 : n + len(ranks)])
        paths.append(ranks)
        n += len(ranks) + 1
    return sizes, paths, seconds


def static_rank_tree(paths: list[tuple[int, ...]], total: int) -> list[tuple[int, ...]]:
    """vLLM serves a static tree of sibling ranks: the `total` rank paths (with their prefixes) most often on the
    accepted path of the dynamic tree, as vLLM writes them: (0,), (1,), (0, 0), ..."""
    counts: dict[tuple[int, ...], int] = {}
    for path in paths:
        for i in range(1, len(path) + 1):
            counts[path[:i]] = counts.get(path[:i], 0) + 1
    # A prefix is counted at least as often as its extensions, so the top `total` hold their prefixes.
    chosen = sorted(counts, key=lambda r: (-counts[r], len(r), r))[:total]
    return sorted(chosen, key=lambda r: (len(r), r))


def candidate_shapes(
    depths: Sequence[int], topks: Sequence[int], totals: Sequence[int], chains: Sequence[int]
) -> list[TreeShape]:
    shapes = [TreeShape(k, 1, k) for k in chains]
    for d in depths:
        for k in topks:
            for t in totals:
                if k > 1 and t <= TreeShape(d, k, 1).capacity and t + 1 <= MAX_VERIFY and t > d:
                    shapes.append(TreeShape(d, k, t))
    return shapes


def fitting(drafter: Drafter, shapes: list[TreeShape]) -> list[TreeShape]:
    """The shapes `drafter` can draft: a DFlash block holds B - 1 draft positions, so deeper ones are left out."""
    from draftsmith.drafters import learned_drafter
    from draftsmith.drafters.dflash import DFlashDrafter

    learned = learned_drafter(drafter)
    if not isinstance(learned, DFlashDrafter):
        return shapes
    return [shape for shape in shapes if shape.depth < learned.block_size]


def tune(
    target: Target,
    make_drafter: Callable[[TreeShape], Drafter],
    prompts: list[list[int]],
    shapes: list[TreeShape],
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> dict:
    """Measure costs and acceptance, predict tokens/s for every shape; returns the report (best first)."""
    log("timing the target's verify forward over 1..64 new tokens")
    verify = verify_costs(target)
    overhead = engine_overhead(target, prompts[0], verify[1])
    probe = make_drafter(shapes[0])
    runs = []
    for i, ids in enumerate(prompts):
        log(f"recording the target's greedy text, prompt {i + 1}/{len(prompts)}")
        runs.append(record(target, probe, ids, max_new_tokens))
    baseline_s = sum(r.prefill_s + (len(r.text) - 1) * (verify[1] + overhead) for r in runs)
    new_tokens = sum(len(r.text) for r in runs)
    results = []
    for shape in shapes:
        drafter = make_drafter(shape)
        replay(drafter, runs[0], shape.total)  # warm-up
        sizes: list[int] = []
        paths: list[tuple[int, ...]] = []
        seconds = draft_s = 0.0
        for run in runs:
            run_sizes, run_paths, drafting = replay(drafter, run, shape.total)
            sizes += run_sizes
            paths += run_paths
            draft_s += drafting
            seconds += run.prefill_s + drafting + sum(verify[m + 1] + overhead for m in run_sizes)
        rounds, forwards = len(sizes), len(sizes) + len(runs)
        verify_s = sum(verify[m + 1] for m in sizes)
        reached = [sum(len(path) > d for path in paths) for d in range(shape.depth)]
        result = ShapeResult(
            str(shape),
            shape.depth,
            shape.topk,
            shape.total,
            acceptance_length=new_tokens / forwards,
            tokens_per_s=new_tokens / seconds,
            draft_ms=1000 * draft_s / max(1, rounds),
            verify_ms=1000 * verify_s / max(1, rounds),
            accepted_by_depth=[r / max(1, rounds) for r in reached],
            rank_tree=static_rank_tree(paths, shape.total) if shape.topk > 1 else [],
        )
        results.append(result)
        log(f"{result.shape}: tau {result.acceptance_length:.2f}, predicted {result.tokens_per_s:.1f} tokens/s")
    results.sort(key=lambda r: -r.tokens_per_s)
    best = results[0]
    return {
        "target": target.name,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "verify_ms": {n: 1000 * s for n, s in verify.items()},
        "engine_overhead_ms": 1000 * overhead,
        "baseline_tokens_per_s": new_tokens / baseline_s,
        "best": asdict(best),
        "shapes": [asdict(r) for r in results],
    }


def engine_flags(best: dict, drafter_dir: str, verifier: str) -> dict:
    """The same shape for SGLang (dynamic trees, as here) and vLLM (a chain, or a static tree of ranks)."""
    depth, topk, total = best["depth"], best["topk"], best["total"]
    sglang = (
        f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {drafter_dir} --speculative-num-steps {depth} "
        f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {total + 1}"
    )
    config: dict = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": total}
    if topk > 1:
        config["num_speculative_tokens"] = len(best["rank_tree"])
        config["speculative_token_tree"] = str([tuple(r) for r in best["rank_tree"]])
    vllm = f"vllm serve {verifier} --speculative-config '{json.dumps(config)}'"
    return {"sglang": sglang, "vllm": vllm}


def write_tune(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "tune.json", json.dumps(report, indent=2) + "\n")


def read_tune(path: Path) -> TreeShape:
    """The best shape of a `tune.json`."""
    try:
        best = json.loads(path.read_text())["best"]
        return TreeShape(best["depth"], best["topk"], best["total"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} is not a tune report: {exc}", hint="pass a tune.json written by `draftsmith tune`"
        ) from None


def predicted_speeds(path: Path, shape: TreeShape, chain: int, chain_suffix: str = "_fixed") -> dict:
    """Tune's predicted tokens/s and speed-up for `shape` (the report's main fields) and for a chain of `chain` tokens
    (`chain_suffix`: `_fixed`, or `_merged` when the drafter tuned was a merge, whose chain is the merged one), where
    its table has them. The speed-up is over the plain decoding tune timed: a host that runs a few % faster or slower
    by the time eval measures moves both tokens/s alike, not their ratio."""
    report = json.loads(path.read_text())
    speeds = {row["shape"]: row["tokens_per_s"] for row in report["shapes"]}
    plain = report.get("baseline_tokens_per_s")
    found = {}
    for suffix, key in (("", str(shape)), (chain_suffix, str(TreeShape(chain, 1, chain)))):
        if key in speeds:
            found[f"predicted_tokens_per_s{suffix}"] = speeds[key]
            if plain:
                found[f"predicted_speedup{suffix}"] = speeds[key] / plain
    return found


def check_tree_spec(spec: str | None) -> str | None:
    """Fail on a malformed `--tree` before any model loads: 'auto', a tune.json, or a shape."""
    if spec is not None and spec != "auto" and not spec.endswith(".json"):
        TreeShape.parse(spec)
    return spec


def resolve_tree(
    spec: str | None, target: Target, drafter: str, dtype: str = "float32", precision: str = "float32"
) -> TreeShape | None:
    """`--tree`: None (chains), an explicit shape, the best shape of a tune.json, or 'auto': a short tune here
    (4 built-in prompts, 64 new tokens, the default grid of shapes, the drafter at the `precision` it will draft at)."""
    if spec is None:
        return None
    if spec.endswith(".json"):
        return read_tune(Path(spec))
    if spec != "auto":
        return TreeShape.parse(spec)
    from draftsmith.data.sources import load_eval_prompts
    from draftsmith.data.tokenize import encode_chat
    from draftsmith.drafters import with_tree
    from draftsmith.formats.load import build_drafter

    _, prompts = load_eval_prompts("builtin", None, 4)
    base = build_drafter(drafter, target, dtype=dtype, draft_length="fixed", precision=precision)
    report = tune(
        target,
        lambda shape: with_tree(base, shape),
        [encode_chat(target.tokenizer, c.messages) for c in prompts],
        fitting(base, candidate_shapes(*DEFAULT_GRID)),
        64,
        log=lambda line: None,
    )
    best = report["best"]
    print(f"--tree auto: {best['shape']} (predicted {best['tokens_per_s']:.1f} tokens/s)", flush=True)
    return TreeShape(best["depth"], best["topk"], best["total"])


def parse_ints(option: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--{option} {text!r} is not a comma-separated list of integers", hint="e.g. 2,4,8") from None


def print_tune(report: dict, console: Console) -> None:
    """The table of every shape tried, best first, then the best one and how to serve it."""
    base = report["baseline_tokens_per_s"]
    table = Table(title=f"{report['drafter']} on {report['target']}: predicted tokens/s (plain decoding {base:.1f})")
    table.add_column("shape (ms are per round)", no_wrap=True)
    for column in ("tau", "draft ms", "verify ms", "tokens/s", "speedup"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in report["shapes"]:
        table.add_row(
            f"chain of {row['depth']}" if row["topk"] == 1 else row["shape"],
            f"{row['acceptance_length']:.2f}",
            f"{row['draft_ms']:.1f}",
            f"{row['verify_ms']:.1f}",
            f"{row['tokens_per_s']:.1f}",
            f"{row['tokens_per_s'] / base:.2f}x",
        )
    console.print(table)
    best = report["best"]
    lines = [
        f"best: {best['shape']}{' (a chain)' if best['topk'] == 1 else ''}: tau {best['acceptance_length']:.2f}, "
        f"{best['tokens_per_s']:.1f} tokens/s predicted ({best['tokens_per_s'] / base:.2f}x)",
        f"  draftsmith eval/serve: --tree {best['shape']}",
        "  P(accepted path reaches depth d): " + " ".join(f"{p:.2f}" for p in best["accepted_by_depth"]),
    ]
    lines += [f"  {engine}: {command}" for engine, command in report.get("flags", {}).items()]
    console.print("\n".join(lines), highlight=False, soft_wrap=True)
