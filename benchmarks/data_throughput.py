"""Data throughput: how many target-written tokens the data stage makes per second, against what a forward allows.

The measurements in one run, on the same prompts and the same (packed) target:

- prefill: one forward (no cache, `logits_to_keep=1`) over batches of the regenerated prompt+answer rows, sorted
  by length so little padding is computed, each batch up to `--prefill-tokens` tokens padding included (not
  `--batch-size` rows: a batch of 384 rows from 42 to 530 tokens computed ~2.5x the tokens it held), with the data
  stage's attention (`batched_attention`). The upper bound: every weight read once serves a whole batch of tokens.
- regeneration: `draftsmith.data.regenerate.regenerate` (the `draftsmith data --regenerate` code path, greedy) over
  the prompts at `--batch-size`; tokens/s counts every token the target wrote, stop tokens included (re-tokenised
  from the output).
- regeneration recorded: the same keeping every token's states (`--record-features`: rows that never drain,
  `backends/stream.py`); printed against regeneration followed by a second pass of extraction.
- self-chat: `draftsmith.data.selfchat.self_chat` (the `draftsmith data --self-chat` code path: the target writes
  both sides of multi-turn chats in a batch that never drains) for as many chats as prompts, `--chat-length`
  tokens each, at `--batch-size`; tokens/s counts every token of the chats.
- self-chat recorded: the same, keeping the hidden states `extract` stores as the chats are written
  (`draftsmith data --record-features`); printed against self-chat followed by a second pass of extraction.
- extraction: `draftsmith.store.extract` (the `draftsmith extract` code path, bf16 shards) over the regenerated
  conversations; tokens/s counts prompt and answer tokens. The target's fingerprint is computed once up front,
  as the stage computes it once per store.

Each measurement runs `--repeats` times, interleaved (the order rotates every round) after warm-ups,
so the noise of a shared machine hits all of them alike; medians are printed with the number of runs. Regeneration
must write the same tokens every run (greedy). The script prints a measurement and always exits 0; measure on a
quiet machine (`../shared/tools/quiet`).

    .venv/bin/python benchmarks/data_throughput.py [--prompts 64] [--max-new-tokens 128] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.backends.batch import batched_attention, pad_id
from draftsmith.data import regenerate as regenerate_module
from draftsmith.data import selfchat as selfchat_module
from draftsmith.data.selfchat import self_chat
from draftsmith.data.sources import Conversation, load_eval_prompts
from draftsmith.data.tokenize import tokenize_conversation
from draftsmith.pipeline import load_pipeline
from draftsmith.store import Recording, default_aux_layers, extract
from draftsmith.target import Target, load_target

ARMS = ("prefill", "regeneration", "regeneration recorded", "self-chat", "self-chat recorded", "extraction")
PROMPT_FILES = ("mt_bench_questions.jsonl", "gsm8k_test.jsonl")  # first turns of each, alternating


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    profile = load_pipeline("eagle3", "cpu-full").data
    cpu_batch = profile.batch_size
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="built-in name, HF directory or hub id")
    parser.add_argument("--batch-size", type=int, default=cpu_batch, help="regeneration batch (cpu profiles' data)")
    parser.add_argument("--prompts", type=int, default=2 * cpu_batch, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=profile.max_new_tokens, help="per answer (cpu-full's)")
    parser.add_argument("--prefill-tokens", type=int, default=16384, help="tokens per prefill batch, padding included")
    parser.add_argument("--extract-max-length", type=int, default=512, help="as in the cpu profiles")
    parser.add_argument("--chat-length", type=int, default=profile.self_chat_length, help="per self-chat (cpu-full's)")
    parser.add_argument("--loop-ngram", type=int, default=profile.self_chat_loop_ngram, help="self-chat (cpu-full's)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of: {', '.join(ARMS)}")
    parser.add_argument("--dtype", default="float32", help="the target's compute dtype")
    parser.add_argument("--data-dir", type=Path, default=os.environ.get("DRAFTSMITH_DATA"), help="benchmark prompts")
    return parser.parse_args(argv)


def load_prompts(data_dir: Path | None, n: int) -> tuple[str, list[Conversation]]:
    """First turns of MT-bench and GSM8K alternating when the data folder has them (GSM8K alone once MT-bench's 80
    run out), else the builtin prompts."""
    files = [Path(data_dir) / name for name in PROMPT_FILES] if data_dir else []
    if files and all(f.is_file() for f in files):
        mt_bench, gsm8k = ([Conversation(f"{f.stem}-{c.id}", c.messages) for c in load_eval_prompts(str(f), limit=n)[1]]
                           for f in files)  # fmt: skip
        mixed = [c for pair in zip(mt_bench, gsm8k, strict=False) for c in pair] + gsm8k[len(mt_bench) :]
        if len(mixed) >= n:
            return " + ".join(f.name for f in files), mixed[:n]
    _, builtin = load_eval_prompts("builtin")
    # repeated when n exceeds the 60 builtins, each repeat under its own id (regeneration refuses duplicate ids)
    repeats = (builtin[i % len(builtin)] for i in range(n))
    return "builtin", [Conversation(f"{i}-{c.id}", c.messages) for i, c in enumerate(repeats)]


def run_regenerate(
    target: Target, convs: list[Conversation], args, work: Path, record: Recording | None = None
) -> tuple[int, float, str]:
    """(tokens written, seconds, the output text) of one regeneration into a fresh file: a batched generate per
    turn, or with `record` rows that never drain keeping every token's states (`--record-features`)."""
    out = Path(tempfile.mkdtemp(dir=work)) / "regenerated.jsonl"
    start = time.perf_counter()
    regenerate_module.regenerate(
        target, convs, out, temperature=0.0, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        seed=0, progress=False, record=record,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    return written_tokens(target, out.read_text()), seconds, out.read_text()


def written_tokens(target: Target, text: str) -> int:
    """Tokens the target wrote in a regeneration output: each assistant turn's tokens, and its stop token if it
    stopped (re-tokenised from the text, the same count for both regeneration paths)."""
    encode = lambda s: target.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = [m for line in text.splitlines() for m in json.loads(line)["messages"] if m["role"] == "assistant"]
    return sum(len(encode(m["content"])) + (not m["truncated"]) for m in turns)


def run_self_chat(target: Target, n: int, args, work: Path, record: Recording | None = None) -> tuple[int, float, str]:
    """(tokens, seconds, the chats) of `n` self-chats into a fresh file; `record`: keeping their hidden states."""
    out = Path(tempfile.mkdtemp(dir=work)) / "chat.jsonl"
    start = time.perf_counter()
    # as the data stage calls it: replies capped at max_new_tokens, the profile's loop rule
    self_chat(target, n, out, seed=0, length=args.chat_length, batch_size=args.batch_size, record=record,
              max_turn_tokens=args.max_new_tokens, loop_ngram=args.loop_ngram, progress=False)  # fmt: skip
    return n * args.chat_length, time.perf_counter() - start, out.read_text()


def run_prefill(target: Target, rows: list[list[int]], budget: int) -> tuple[int, float]:
    """(tokens, seconds) of forwards over `rows` in length-sorted, right-padded batches of up to `budget` tokens
    (padding included; a longer row alone)."""
    model = target.model
    rows = sorted(rows, key=len)
    batches = [[rows[0]]]
    for row in rows[1:]:  # sorted: the new row is the widest of its batch
        if (len(batches[-1]) + 1) * len(row) > budget:
            batches.append([])
        batches[-1].append(row)
    pad = pad_id(target)
    start = time.perf_counter()
    with torch.inference_mode(), batched_attention(model):  # the attention the data stage's batches run
        for batch in batches:
            width = max(map(len, batch))
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in batch])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in batch])
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    return sum(map(len, rows)), time.perf_counter() - start


def run_extract(target: Target, samples: list, args, work: Path) -> tuple[int, float]:
    out = Path(tempfile.mkdtemp(dir=work)) / "store"
    start = time.perf_counter()
    extract(target, samples, out, dtype="bfloat16", max_length=args.extract_max_length, progress=False,
            console=_quiet_console())  # fmt: skip
    return sum(min(len(s[1]), args.extract_max_length) for s in samples), time.perf_counter() - start


def _quiet_console():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    source, convs = load_prompts(args.data_dir, args.prompts)
    target = load_target(args.target, dtype=args.dtype)
    fingerprint = target.fingerprint()
    target.fingerprint = lambda: fingerprint  # once per run, as the extract stage computes it once per store
    regenerate_module.console.quiet = selfchat_module.console.quiet = True
    print(
        f"{target.name} ({args.dtype}), {args.threads} threads: {len(convs)} prompts ({source}), "
        f"batch {args.batch_size}, "
        f"{args.max_new_tokens} new tokens, greedy; {args.repeats} interleaved runs of each after a warm-up",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Warm-up, and the regenerated conversations that prefill and extraction run over.
        _, _, text = run_regenerate(target, convs, args, work)
        regenerated = [Conversation(r["id"], r["messages"]) for r in map(json.loads, text.splitlines())]
        samples = []
        for conv in regenerated:
            ids, mask = tokenize_conversation(target.tokenizer, conv.messages, args.extract_max_length, conv_id=conv.id)
            samples.append((conv.id, ids, mask))
        rows = [ids for _, ids, _ in samples]
        rates: dict[str, list[float]] = {name: [] for name in ARMS if name in args.arms.split(",")}
        record = Recording(fingerprint, default_aux_layers(target.num_layers), "transformers")
        warm_ups = {
            "prefill": lambda: run_prefill(target, rows[: args.batch_size], args.prefill_tokens),
            "extraction": lambda: run_extract(target, samples[:2], args, work),
            "self-chat": lambda: run_self_chat(target, 2, args, work),
            "self-chat recorded": lambda: run_self_chat(target, 2, args, work, record),
        }
        for name in rates:
            warm_ups.get(name, lambda: None)()
        identical = 0
        for r in range(args.repeats):
            order = list(rates)
            order = order[r % len(order) :] + order[: r % len(order)]
            for name in order:
                if name == "prefill":
                    tokens, seconds = run_prefill(target, rows, args.prefill_tokens)
                elif name.startswith("regeneration"):
                    recording = record if name.endswith("recorded") else None
                    tokens, seconds, again = run_regenerate(target, convs, args, work, recording)
                    identical += again == text
                elif name.startswith("self-chat"):
                    recording = record if name.endswith("recorded") else None
                    tokens, seconds, _ = run_self_chat(target, len(convs), args, work, recording)
                else:
                    tokens, seconds = run_extract(target, samples, args, work)
                rates[name].append(tokens / seconds)
                print(f"  round {r + 1}: {name:<26} {tokens:>7} tokens in {seconds:7.2f} s = {tokens / seconds:7.1f} "
                      "tokens/s", flush=True)  # fmt: skip

    median = {name: statistics.median(v) for name, v in rates.items()}
    print()
    for name, value in median.items():
        print(f"{name:<26} {value:8.1f} tokens/s  (median of {len(rates[name])} runs)")
    for name in ("regeneration", "regeneration recorded", "self-chat", "self-chat recorded", "extraction"):
        if name in median and "prefill" in median:
            print(f"{name + ' / prefill':<40} = {median[name] / median['prefill']:.2f}")
    if {"regeneration", "extraction", "regeneration recorded"} <= set(median):
        stored = sum(map(len, rows)) / written_tokens(target, text)  # tokens extraction reads per token written
        two_pass = 1 / (1 / median["regeneration"] + stored / median["extraction"])
        print(f"regeneration then extraction (two passes) {two_pass:.1f} written tokens/s; recorded in one pass "
              f"{median['regeneration recorded']:.1f} = {median['regeneration recorded'] / two_pass:.2f}x")  # fmt: skip
    if {"self-chat", "extraction", "self-chat recorded"} <= set(median):
        two_pass = 1 / (1 / median["self-chat"] + 1 / median["extraction"])
        print(f"self-chat then extraction (two passes) {two_pass:.1f} tokens/s; recorded in one pass "
              f"{median['self-chat recorded']:.1f} = {median['self-chat recorded'] / two_pass:.2f}x")  # fmt: skip
    runs = sum(len(v) for name, v in rates.items() if name.startswith("regeneration"))
    print(f"regenerations identical to the warm-up run: {identical}/{runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
