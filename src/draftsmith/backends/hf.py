"""The transformers backend: the target as `load_target` loaded it, on its own device, one process.

Generation is `draftsmith.backends.batch.generate_batch` (a left-padded batch whose finished rows leave it; synthesis
uses it, while regeneration drives `target` itself in rows that never drain, `backends/stream.py`);
features are one `Target.forward` per sample (in a cast copy of the target with
`backend_options: {dtype: ...}`) with pre-hooks on the chosen decoder layers (see `draftsmith.target`
for the layer-id convention). Both are what the data and extract stages did before backends existed, so stores
and regenerations made by either are identical.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import transformers
from rich.console import Console

from draftsmith.backends import batch
from draftsmith.target import AUTO, Target


class TransformersBackend:
    name = "transformers"

    def __init__(self, target: Target, dtype: str | None = None) -> None:
        """`dtype`: compute in a copy of the target cast to it (`Target.cast`; bf16 on a CPU with AMX; `auto`: bf16
        only where it is native). The manifest records the dtype it resolved to."""
        self.target = target if dtype is None else target.cast(dtype)
        self.compute_dtype = None if self.target is target else str(self.target.model.dtype).removeprefix("torch.")
        if dtype == AUTO and self.compute_dtype is None and target.model.dtype != torch.bfloat16:
            Console(stderr=True).print(
                f"dtype auto: bf16 is not native on this {target.device.type}, computing in "
                f"{str(target.model.dtype).removeprefix('torch.')}"
            )

    def generate(
        self,
        prompts: Sequence[list[int]],
        *,
        temperature: float,
        max_new_tokens: int,
        stop_ids: set[int],
        seed: int,
    ) -> list[tuple[list[int], bool]]:
        """Samples from the global torch RNG, which the callers seed per batch (`seed` is for engines that keep
        their own RNG); looked up on the module at call time so tests can replace it."""
        return batch.generate_batch(
            self.target, prompts, temperature=temperature, max_new_tokens=max_new_tokens, stop_ids=stop_ids
        )

    def features(
        self, samples: Sequence[torch.Tensor], layer_ids: tuple[int, ...]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        target = self.target
        for ids in samples:
            out = target.forward(ids.long(), target.new_cache(), layer_ids, logits_to_keep=1, last_hidden=True)
            yield out.aux_hidden, out.last_hidden

    def describe(self) -> dict[str, Any]:
        described = {"name": self.name, "transformers": transformers.__version__, "torch": torch.__version__}
        return described | ({"compute_dtype": self.compute_dtype} if self.compute_dtype else {})

    def close(self) -> None:
        pass  # the target belongs to the caller, who uses it again
