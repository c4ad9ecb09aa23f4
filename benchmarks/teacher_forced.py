"""Where a drafter's acceptance is lost: its top-1 per draft step along the target's own greedy replies.

For each eval prompt the target writes its greedy reply; the drafter then runs its training-time forward
(`ttt_forward`) over prompt + reply with the target's features, and step k at position t is scored against the
target's argmax at t+1+k over the reply's tokens. Compared with `eval`'s first-token acceptance this separates an
engine fault (teacher-forced >> engine) from distribution shift (teacher-forced low too, validation high); run with
the features of a cast copy (`--feature-dtype bfloat16`, how the cpu profiles build their stores) it shows what the
store's precision costs. The first step's top-1 is also split by position in the reply (`--buckets`): a small
target's greedy replies drift into loops that a drafter predicts well, so a reply's opening is where a training
set of long self-chats and a benchmark of 128-token answers differ most. `--chats RUN/data` scores the first
replies of the last `--limit` self-chats the same way (the training distribution; mostly training samples).

Step 1 is also split four ways, to tell a harder text from a drafter that does not carry over: by the prompt's kind;
by the target's own top-1 probability at the predicted token (a harder text has more tokens the target is unsure
of); by whether the target's token is in the draft vocabulary (outside it nothing can be accepted); and by whether
the token pair (previous token, token) occurred earlier in the prompt or reply (a copy, which attention over the
context can find) or is new. No timing.

    .venv/bin/python benchmarks/teacher_forced.py --drafter runs/demo/train/checkpoints/step-000120 \\
        [--dataset mt_bench] [--limit 10] [--max-new-tokens 128] [--steps 4] [--feature-dtype bfloat16] \\
        [--buckets 32,64,128,256] [--chats runs/demo/data]
"""

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from draftsmith.data.sources import load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.formats.load import load_drafter
from draftsmith.target import load_target
from draftsmith.train.losses import ttt_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="an EAGLE-3 run, checkpoint or exported directory")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("DRAFTSMITH_DATA", "../shared/data")))
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--feature-dtype", default=None, help="also score with features from a cast copy")
    parser.add_argument("--buckets", default="32,64,128,256", help="reply positions where step 1's buckets split")
    parser.add_argument("--chats", type=Path, default=None, help="a data directory with chat.jsonl (self-chats)")
    args = parser.parse_args()

    target = load_target(args.target)
    model = load_drafter(args.drafter, target).model.float()
    feature_targets = {"float32": target} | (
        {args.feature_dtype: target.cast(args.feature_dtype)} if args.feature_dtype else {}
    )
    edges = [0, *(int(b) for b in args.buckets.split(",")), 1 << 30]
    _, prompts = load_eval_prompts(args.dataset, args.data_dir, args.limit)
    with torch.inference_mode():
        sources = {f"{args.dataset}, first {len(prompts)} prompts, greedy replies of up to {args.max_new_tokens}": [
            (ids, greedy_reply(target, ids, args.max_new_tokens), conv.kind)
            for conv in prompts for ids in [encode_chat(target.tokenizer, conv.messages)]
        ]}  # fmt: skip
        if args.chats:
            sources[f"self-chats of {args.chats}, first replies of the last {args.limit}"] = first_replies(
                target, args.chats / "chat.jsonl", args.limit
            )
        for title, pairs in sources.items():
            print(title)
            for name, source in feature_targets.items():
                by_step, by_bucket, splits = score(model, target, source, pairs, args.steps, edges)
                steps_line = " / ".join(f"{v:.3f}" for v in by_step)
                print(f"  features in {name}: teacher-forced top-1 by draft step {steps_line}")
                spans = zip(edges, edges[1:], strict=False)
                print("    step 1 by reply position:", "  ".join(
                    f"[{lo},{hi if hi < 1 << 30 else 'end'}) {hit / n:.3f} (n={n})"
                    for (lo, hi), (hit, n) in zip(spans, by_bucket, strict=True) if n
                ))  # fmt: skip
                total = sum(n for _, n in by_bucket)
                for split, cells in splits.items():
                    print(f"    step 1 by {split}:", "  ".join(
                        f"{cell} {hit / n:.3f} ({n / total:.0%})" for cell, (hit, n) in sorted(cells.items())
                    ))  # fmt: skip


def greedy_reply(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def first_replies(target, chats: Path, limit: int) -> list[tuple[list[int], list[int], str | None]]:
    """(prompt ids, reply ids, kind) of the first user turn and the target's reply in the last `limit` self-chats."""
    rows = [json.loads(line) for line in chats.read_text().splitlines() if line.strip()][-limit:]
    return [
        (encode_chat(target.tokenizer, row["messages"][:1]),
         target.tokenizer(row["messages"][1]["content"], add_special_tokens=False)["input_ids"],
         row.get("kind"))
        for row in rows
    ]  # fmt: skip


def score(
    model, target, source, pairs, steps: int, edges: list[int]
) -> tuple[list[float], list[tuple[int, int]], dict[str, dict[str, list[int]]]]:
    """Top-1 per draft step over all replies, step 1's (hits, scored) per bucket of reply position, and step 1's
    [hits, scored] per cell of each split (`split_cells`)."""
    hits, scored = torch.zeros(steps), torch.zeros(steps)
    buckets = [[0, 0] for _ in edges[1:]]
    splits: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    in_vocab = torch.zeros(target.model.config.vocab_size, dtype=torch.bool)
    in_vocab[model.draft_to_target(torch.arange(model.config.draft_vocab_size))] = True
    for prompt_ids, reply_ids, kind in pairs:
        seq = torch.tensor(prompt_ids + reply_ids)
        probs = target.forward(seq, target.new_cache()).logits.float().softmax(-1)
        confidence, labels = probs.max(-1)  # the served target's argmax and its probability
        features = source.forward(seq, source.new_cache(), tuple(model.config.aux_layer_ids)).aux_hidden
        for k, hidden in enumerate(ttt_forward(model, seq[None], features.float()[None], steps)):
            positions = torch.arange(max(len(prompt_ids) - 2 - k, 0), len(seq) - 2 - k)
            drafted = model.draft_to_target(model.draft_logits(hidden[0, positions]).argmax(-1))
            right = drafted == labels[positions + 1 + k]
            hits[k] += right.sum()
            scored[k] += len(positions)
            if k == 0:  # position t predicts reply token t + 2 - len(prompt)
                for t, ok in zip(positions.tolist(), right.tolist(), strict=True):
                    at = t + 2 - len(prompt_ids)
                    bucket = next(i for i, hi in enumerate(edges[1:]) if at < hi)
                    buckets[bucket][0] += ok
                    buckets[bucket][1] += 1
                    for split, cell in split_cells(seq, t + 2, int(labels[t + 1]), float(confidence[t + 1]),
                                                   in_vocab, kind).items():  # fmt: skip
                        splits[split][cell][0] += ok
                        splits[split][cell][1] += 1
    return (hits / scored).tolist(), [(h, n) for h, n in buckets], splits


CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.9)


def split_cells(
    seq: torch.Tensor, at: int, label: int, confidence: float, in_vocab: torch.Tensor, kind: str | None
) -> dict[str, str]:
    """Which cell of each split the prediction of token `at` (the target's argmax `label`) falls in."""
    previous = int(seq[at - 1])
    earlier = seq[: at - 1]  # bigrams (earlier[j], seq[j + 1]) that end before `at`
    copied = bool(((earlier == previous) & (seq[1:at] == label)).any())
    low = max(e for e in (0.0, *CONFIDENCE_EDGES) if confidence >= e)
    return {
        "kind": kind or "?",
        "target top-1 probability": f">={low:.1f}",
        "draft vocabulary": "in" if in_vocab[label] else "out",
        "token pair": "seen before" if copied else "new",
    }


if __name__ == "__main__":
    main()
