"""Are the hidden states recorded while the target writes its self-chats as good as a second pass of extraction?

`draftsmith data --record-features` keeps every self-chat token's states from the decode step that fed it
(`Target.recording`); `draftsmith extract` computes them in one forward over the whole chat. On a CPU both run in a
bf16 copy of the target (`dtype: auto`) while serving computes float32, so the question is not whether the two agree
bit for bit (they round differently) but whether the recorded ones are as close to float32's as extraction's are.
Prints, per stored state (each aux layer, then the final normed state), the mean |bf16 - float32| of both, over the
first `--check` chats, and how many of the chats re-tokenise (text -> tokens, as `tokenize` would store them) to the
very tokens the target wrote. No timing.

    .venv/bin/python benchmarks/recorded_states.py [--chats 32] [--check 8] [--length 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from draftsmith.backends.hf import TransformersBackend
from draftsmith.data.regenerate import recorded_dir
from draftsmith.data.selfchat import self_chat
from draftsmith.data.tokenize import tokenize_conversation
from draftsmith.store import RecordedFeatures, Recording, default_aux_layers, engine_label
from draftsmith.target import load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--chats", type=int, default=32, help="self-chats written (one batch)")
    parser.add_argument("--check", type=int, default=8, help="chats whose states are compared with float32's")
    parser.add_argument("--length", type=int, default=256, help="tokens per chat, as in the cpu profiles")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = load_target(args.target)
    cast, exact = TransformersBackend(target, "auto"), TransformersBackend(target)
    layers = default_aux_layers(target.num_layers)
    record = Recording(cast.target.fingerprint(), layers, engine_label(cast.describe()))
    with tempfile.TemporaryDirectory() as tmp:
        chats = Path(tmp) / "chat.jsonl"
        self_chat(cast.target, args.chats, chats, seed=0, length=args.length, batch_size=args.chats,
                  max_turn_tokens=args.length // 2, record=record, progress=False)  # fmt: skip
        recorded = RecordedFeatures(recorded_dir(chats))
        same_tokens = 0
        gaps = torch.zeros(2, len(layers) + 1)  # (extracted, recorded) x (aux layers..., final)
        records = [json.loads(line) for line in chats.read_text().splitlines()]
        for i, chat in enumerate(records):
            ids, _ = recorded.sample(chat["id"])
            written, _ = tokenize_conversation(target.tokenizer, chat["messages"], 10 * args.length)
            shared = min(len(ids), len(written))  # the turn in progress at the end is cut differently
            same_tokens += ids[:shared] == written[:shared]
            if i >= args.check:
                continue
            x = torch.tensor(ids)
            (aux32, last32), (aux16, last16) = (next(b.features([x], layers)) for b in (exact, cast))
            aux_rec, last_rec = recorded.features(chat["id"], x.to(torch.int32))
            for row, (aux, last) in enumerate(((aux16, last16), (aux_rec, last_rec))):
                parts = [*aux.float().chunk(len(layers), dim=-1), last.float()]
                wanted = [*aux32.chunk(len(layers), dim=-1), last32]
                gaps[row] += torch.tensor([(a - w).abs().mean() for a, w in zip(parts, wanted, strict=True)])
    gaps /= min(args.check, len(records))
    names = [f"layer {i}" for i in layers] + ["final"]
    print(f"{target.name}: {len(records)} self-chats of {args.length} tokens, written in {record.engine}")
    print(f"mean |state - float32 state| over the first {min(args.check, len(records))} chats:")
    for j, name in enumerate(names):
        print(f"  {name:<9} extracted {gaps[0, j]:.4f}   recorded {gaps[1, j]:.4f}")
    print(f"chats whose text re-tokenises to the tokens written: {same_tokens} of {len(records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
