"""How much of the target's writing is loops: in a data stage's chats and in its greedy replies to eval prompts.

A small target's greedy replies often repeat themselves, and every token of a loop is a token of training data
that teaches the drafter nothing new (and that an n-gram drafter gets for free at serving time). For each reply
(the first `--first` tokens of it) this prints the share of tokens whose previous `--n` tokens already occurred
earlier in the same conversation followed by the same token (copies), and the share a reply keeps when it is cut
before its first repeated `--cut`-gram (what `data.self_chat_loop_ngram` does while the chats are written).
No timing.

    .venv/bin/python benchmarks/data_loops.py --data runs/demo/data [--dataset mt_bench --limit 20]
"""

import argparse
import json
import os
from pathlib import Path

import torch

from draftsmith.data.sources import load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.target import load_target


def reply_stats(context: list[int], reply: list[int], n: int, cut: int) -> tuple[int, int, int]:
    """(tokens, tokens copying an earlier n-gram's successor, tokens before the first repeated cut-gram)."""
    full, start = context + reply, len(context)
    successor: dict[tuple[int, ...], int] = {}
    copies = 0
    for i in range(n, len(full)):
        gram = tuple(full[i - n : i])
        copies += i >= start and successor.get(gram) == full[i]
        successor[gram] = full[i]
    seen: set[tuple[int, ...]] = set()
    kept = len(reply)
    for i in range(cut, len(reply) + 1):
        gram = tuple(reply[i - cut : i])
        if gram in seen:
            kept = i - 1
            break
        seen.add(gram)
    return len(reply), copies, kept


def conversation_stats(tokenizer, messages: list[dict], first: int, n: int, cut: int) -> list[tuple[int, int, int]]:
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    context: list[int] = []
    rows = []
    for message in messages:
        tokens = encode(message["content"])
        if message["role"] == "assistant":
            rows.append(reply_stats(context, tokens[:first], n, cut))
        context += tokens
    return rows


def print_row(name: str, rows: list[tuple[int, int, int]], n: int, cut: int) -> None:
    tokens, copies, kept = (sum(r[i] for r in rows) for i in range(3))
    cut_replies = sum(k < t for t, _, k in rows)
    share = f"{copies / tokens:.3f} | {cut_replies}/{len(rows)} | {kept / tokens:.2f}"
    print(f"| {name} | {len(rows)} | {tokens} | {share} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, action="append", default=[], help="a data stage directory (repeatable)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dataset", default="mt_bench", help="eval prompts the target replies to greedily")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("DRAFTSMITH_DATA", "../shared/data")))
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--first", type=int, default=128, help="score the first N tokens of each reply")
    parser.add_argument("--n", type=int, default=3, help="n-gram length of a copy")
    parser.add_argument("--cut", type=int, default=12, help="n-gram length of the loop cut")
    args = parser.parse_args()

    target = load_target(args.target)
    print(f"first {args.first} tokens of each reply; copies: {args.n}-gram successor seen before in the conversation")
    print(f"| source | replies | tokens | copies | replies cut at a repeated {args.cut}-gram | tokens kept |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for data in args.data:
        rows = []
        for name in ("chat.jsonl", "regenerated.jsonl"):
            path = data / name
            for line in path.read_text().splitlines() if path.exists() else []:
                record = json.loads(line)
                rows += conversation_stats(target.tokenizer, record["messages"], args.first, args.n, args.cut)
        print_row(str(data), rows, args.n, args.cut)
    if args.limit:
        _, prompts = load_eval_prompts(args.dataset, args.data_dir, args.limit)
        rows = []
        with torch.inference_mode():
            for conv in prompts:
                ids = encode_chat(target.tokenizer, conv.messages)
                prompt = torch.tensor([ids])
                out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                            max_new_tokens=args.max_new_tokens)[0, len(ids) :]  # fmt: skip
                reply = target.tokenizer.decode(out, skip_special_tokens=True)
                rows += conversation_stats(target.tokenizer, [*conv.messages, {"role": "assistant", "content": reply}],
                                           args.first, args.n, args.cut)  # fmt: skip
        print_row(f"target's greedy replies, first {len(prompts)} {args.dataset}", rows, args.n, args.cut)


if __name__ == "__main__":
    main()
