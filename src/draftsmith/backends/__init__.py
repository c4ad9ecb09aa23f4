"""Engine backends for the two stages that run the target at scale: regeneration (data) and feature extraction.

A backend answers two questions the same way whatever engine is behind it:

- `generate(prompts, ...)`: the target's continuation of each prompt (token ids in, token ids out), for
  `draftsmith data --regenerate` and self-synthesised prompts;
- `features(samples, layer_ids)`: the aux hidden states (inputs of the given decoder layers, concatenated) and the
  final normed hidden state of every token of each sample, for `draftsmith extract`.

`transformers` (the default; runs wherever the target loads) and `vllm` (GPU, much faster for large targets and
datasets) are the two implementations. The store's manifest records which backend produced the features, because
two engines never compute bit-identical hidden states; `draftsmith doctor` reads it to tell a backend difference
from a broken target.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from draftsmith.errors import ConfigError
from draftsmith.target import Target

BACKENDS = ("transformers", "vllm")


class Backend(Protocol):
    name: str

    def generate(
        self,
        prompts: Sequence[list[int]],
        *,
        temperature: float,
        max_new_tokens: int,
        stop_ids: set[int],
        seed: int,
    ) -> list[tuple[list[int], bool]]:
        """(new tokens without the stop token, whether a stop token ended them) per prompt, in order."""
        ...

    def features(
        self, samples: Sequence[torch.Tensor], layer_ids: tuple[int, ...]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(aux_hidden (T, n*H), last_hidden (T, H)) per sample of T token ids, in order, one at a time."""
        ...

    def describe(self) -> dict[str, Any]:
        """What produced the output (name, versions, settings), for manifests."""
        ...

    def close(self) -> None:
        """Free the engine's memory (a GPU engine holds most of the device until closed)."""
        ...


def get_backend(name: str, target: Target, options: dict[str, Any] | None = None) -> Backend:
    """The backend `name` for `target`; `options` go to the engine (vLLM: `LLM(...)` keyword arguments)."""
    if name == "transformers":
        from draftsmith.backends.hf import TransformersBackend

        extra = sorted(set(options or {}) - {"dtype"})
        if extra:
            raise ConfigError(
                f"the transformers backend takes only the backend_option dtype, found {extra}",
                hint="remove them, or use backend: vllm",
            )
        return TransformersBackend(target, (options or {}).get("dtype"))
    if name == "vllm":
        from draftsmith.backends.vllm import VllmBackend

        return VllmBackend(target, options or {})
    raise ConfigError(f"unknown backend {name!r}", hint=f"use one of {', '.join(BACKENDS)}")
