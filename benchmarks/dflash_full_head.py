"""What a DFlash drafter trained with `--draft-loss` keeps when an engine decodes it with the full head.

`--draft-loss` scores the block loss over the draft vocabulary's head rows, the only rows draftsmith's engine
drafts from. vLLM, SGLang and llama.cpp load the exported drafter (z-lab layout, no draft vocabulary) and take the
argmax over the target's whole head, whose other rows training never pushed down. This replays, at T=0 along the
target's own greedy replies, the same checkpoint twice: as draftsmith's engine drafts it (draft-vocabulary rows)
and as exported for the other engines (`export --format zlab`, loaded back) — a fixed block of `--block` tokens,
acceptance only, no timing. A drafter trained on the full head is the control (`--drafter` takes several).

    .venv/bin/python benchmarks/dflash_full_head.py --drafter runs/dfl-b4/train [--drafter runs/dfl50/train] \\
        [--dataset mt_bench] [--limit 40] [--max-new-tokens 128] [--block 3]
"""

import argparse
import os
import tempfile
from pathlib import Path

from draftsmith.config import EvalConfig
from draftsmith.data.sources import load_eval_prompts
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.base import NullDrafter
from draftsmith.evaluate import replayed_report
from draftsmith.formats.export import export
from draftsmith.formats.load import load_dflash
from draftsmith.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", required=True, help="a DFlash run or checkpoint directory")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("DRAFTSMITH_DATA", "../shared/data")))
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block", type=int, default=3, help="draft tokens a round (block size - 1 or fewer)")
    args = parser.parse_args()

    target = load_target(args.target)
    dataset, prompts = load_eval_prompts(args.dataset, args.data_dir, args.limit)
    encoded = [encode_chat(target.tokenizer, conv.messages) for conv in prompts]
    plain = SpeculativeDecoder(target, NullDrafter(), 1)
    texts = [plain.generate(ids, args.max_new_tokens).tokens for ids in encoded]
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.block)
    print(f"{dataset}, first {len(prompts)} prompts, greedy replies of up to {args.max_new_tokens} tokens, T=0, "
          f"a fixed block of {args.block}")  # fmt: skip
    print("| drafter | decoded with | draft vocabulary | tau | P(accepted) by position |")
    print("| --- | --- | ---: | ---: | --- |")
    for path in args.drafter:
        with tempfile.TemporaryDirectory() as tmp:
            exported = export(path, Path(tmp) / "zlab", "zlab")
            for label, drafter in [("draftsmith's engine", load_dflash(path, target)),
                                   ("the z-lab export (full head)", load_dflash(exported, target))]:  # fmt: skip
                report = replayed_report(target, drafter, prompts, encoded, texts, cfg)
                ids = drafter.draft_ids
                by_position = " / ".join(f"{p:.3f}" for p in report["acceptance_by_position"])
                print(f"| {path} | {label} | {'all' if ids is None else len(ids)} | "
                      f"{report['acceptance_length']:.2f} | {by_position} |")  # fmt: skip


if __name__ == "__main__":
    main()
