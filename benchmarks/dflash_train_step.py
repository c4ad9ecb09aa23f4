"""What one DFlash training micro-batch costs (forward + backward) with the loss over the target's full head and
over the draft vocabulary's rows (`draft_loss`), interleaved on the same samples of a store.

Why: on a CPU the full 49k-row head over every block position was over half of a step; this prints both medians and
their ratio. Measure on a quiet machine (`../shared/tools/quiet`); always exits 0.

    .venv/bin/python benchmarks/dflash_train_step.py --store runs/full/extract --vocab runs/full/vocab
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from draftsmith.drafters.dflash import DFlashConfig, DFlashModel
from draftsmith.store import HiddenStateStore
from draftsmith.target import load_target
from draftsmith.train.losses import DFlashObjective, target_top
from draftsmith.train.trainer import collate
from draftsmith.vocab import DraftVocab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--vocab", type=Path, required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    target, store = load_target(args.target), HiddenStateStore(args.store)
    d2t = DraftVocab.load(args.vocab).d2t
    head = target.model.get_output_embeddings().weight.detach().float()
    config = DFlashConfig.from_target(target, args.layers, store.layer_ids, args.block_size, None, "bench",
                                      draft_vocab_size=len(d2t))  # fmt: skip
    model = DFlashModel(config).attach(target.model.get_input_embeddings().weight.detach(), head)
    model.draft_ids.copy_(torch.arange(len(d2t)) + d2t.long())
    samples = [store[i] for i in range(args.micro_batch)]
    samples = [s | {"target_top": target_top(s["last_hidden"], head.bfloat16())} for s in samples]
    batch = collate(samples, 512, torch.device("cpu")) | {"index": torch.arange(args.micro_batch)}
    arms = {name: DFlashObjective(args.block_size, None, args.anchors, False, draft_loss=name == "draft rows")
            for name in ("full head", "draft rows")}  # fmt: skip
    batch = arms["full head"].prepare(batch, 0)
    denominators, seconds = arms["full head"].valid(batch), {name: [] for name in arms}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, objective in arms.items():
            began = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = objective(model, batch, head, denominators)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if repeat:
                seconds[name].append(time.perf_counter() - began)
    median = {name: statistics.median(times) for name, times in seconds.items()}
    for name, value in median.items():
        print(f"{name}: {value:.3f} s a micro-batch of {args.micro_batch} (median of {args.repeats})")
    print(f"draft rows / full head: {median['draft rows'] / median['full head']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
