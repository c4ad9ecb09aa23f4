"""`draftsmith train --online`: the target computes each sample's features when the trainer draws it.

The items, metadata and checks are those of an extract store (store.HiddenStateStore), so the trainer cannot tell
the two apart. Online costs one target forward per sample per epoch and no disk; a store costs one forward in
all and ~4.6 KB per token for SmolLM2 in bf16. Online pays when the data is seen about once (large GPU runs) or the
disk is small; a store pays for several epochs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from draftsmith.data.stage import load_stage_conversations
from draftsmith.data.tokenize import tokenize_dataset
from draftsmith.errors import DraftsmithError
from draftsmith.store import LAYER_CONVENTION, STORE_DTYPES, check_layer_ids, default_aux_layers
from draftsmith.target import Target


class OnlineFeatures(Dataset):
    def __init__(
        self,
        target: Target,
        data_dir: Path | str,
        layer_ids: Sequence[int] | None = None,
        max_length: int = 2048,
        dtype: str = "float32",
    ) -> None:
        self.target = target
        conversations = load_stage_conversations(Path(data_dir))
        self.samples = [
            (sid, torch.tensor(ids[:max_length]), torch.tensor(mask[:max_length], dtype=torch.bool))
            for sid, ids, mask in tokenize_dataset(target.tokenizer, conversations, max_length)
        ]
        self.layer_ids = check_layer_ids(layer_ids or default_aux_layers(target.num_layers), target.num_layers)
        self.dtype = STORE_DTYPES[dtype]
        self.manifest = {
            "stage": "online",
            "data": str(data_dir),
            "target": target.name,
            "target_fingerprint": target.fingerprint(),
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "layer_ids": list(self.layer_ids),
            "layer_convention": LAYER_CONVENTION,
            "dtype": dtype,
            "eos_token_ids": sorted(target.eos_token_ids),
            "special_token_ids": sorted(set(getattr(target.tokenizer, "all_special_ids", [])) | target.eos_token_ids),
            "samples": len(self.samples),
            "tokens": sum(len(ids) for _, ids, _ in self.samples),
            "masked_tokens": sum(int(mask.sum()) for _, _, mask in self.samples),
        }

    def check_compatible(self, target: Target, layer_ids: Sequence[int] | None = None) -> None:
        if target.fingerprint() != self.manifest["target_fingerprint"]:
            raise DraftsmithError(
                f"online features come from {self.target.name}, not {target.name}", hint="use one target throughout"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        _, ids, mask = self.samples[index]
        with torch.inference_mode():
            out = self.target.forward(ids, self.target.new_cache(), self.layer_ids, logits_to_keep=1, last_hidden=True)
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "aux_hidden": out.aux_hidden.to("cpu", self.dtype).clone(),
            "last_hidden": out.last_hidden.to("cpu", self.dtype).clone(),
        }

    def lengths(self) -> list[int]:
        return [len(ids) for _, ids, _ in self.samples]

    def iter_tokens(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _, ids, mask in self.samples:
            yield ids, mask
