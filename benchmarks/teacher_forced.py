"""Where a drafter's acceptance is lost: its top-1 per draft step along the target's own greedy replies.

For each eval prompt the target writes its greedy reply; the drafter then runs its training-time forward
(`ttt_forward`) over prompt + reply with the target's features, and step k at position t is scored against the
target's argmax at t+1+k over the reply's tokens. Compared with `eval`'s first-token acceptance this separates an
engine fault (teacher-forced >> engine) from distribution shift (teacher-forced low too, validation high); run with
the features of a cast copy (`--feature-dtype bfloat16`, how the cpu profiles build their stores) it shows what the
store's precision costs. No timing.

    .venv/bin/python benchmarks/teacher_forced.py --drafter runs/demo/train/checkpoints/step-000120 \\
        [--dataset mt_bench] [--limit 10] [--max-new-tokens 128] [--steps 4] [--feature-dtype bfloat16]
"""

import argparse
import os
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
    args = parser.parse_args()

    target = load_target(args.target)
    model = load_drafter(args.drafter, target).model.float()
    feature_targets = {"float32": target} | (
        {args.feature_dtype: target.cast(args.feature_dtype)} if args.feature_dtype else {}
    )
    _, prompts = load_eval_prompts(args.dataset, args.data_dir, args.limit)
    hits = {name: torch.zeros(args.steps) for name in feature_targets}
    scored = torch.zeros(args.steps)
    with torch.inference_mode():
        for conv in prompts:
            ids = torch.tensor([encode_chat(target.tokenizer, conv.messages)])
            reply = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                          do_sample=False)[0]  # fmt: skip
            labels = target.forward(reply, target.new_cache()).logits.argmax(-1)  # the served target's argmax
            for name, source in feature_targets.items():
                features = source.forward(reply, source.new_cache(), tuple(model.config.aux_layer_ids)).aux_hidden
                for k, hidden in enumerate(ttt_forward(model, reply[None], features.float()[None], args.steps)):
                    positions = torch.arange(max(ids.shape[1] - 2 - k, 0), len(reply) - 2 - k)
                    drafted = model.draft_to_target(model.draft_logits(hidden[0, positions]).argmax(-1))
                    hits[name][k] += (drafted == labels[positions + 1 + k]).sum()
            scored += torch.tensor([len(reply) - 2 - k - max(ids.shape[1] - 2 - k, 0) for k in range(args.steps)])
    print(f"{args.dataset}, first {len(prompts)} prompts, greedy replies of up to {args.max_new_tokens} tokens")
    for name, h in hits.items():
        print(f"features in {name}: teacher-forced top-1 by draft step", " / ".join(f"{v:.3f}" for v in h / scored))


if __name__ == "__main__":
    main()
