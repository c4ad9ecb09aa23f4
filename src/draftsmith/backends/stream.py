"""A batch that never drains: rows that finish a sequence start the next one in place, so every step is full.

`generate_batch` decodes a batch until its longest row ends; on a CPU a decode step over a few rows costs nearly
what one over all of them does, so the tail of every batch is mostly waste (regeneration ran at ~0.3x the prefill
rate that way). Here each row writes into its own slots of a preallocated KV cache: a row whose sequence ended is
reset (its slots masked out, its positions back to 0) and fed its next prompt one token per step beside the rows
still writing. Every step feeds one token per row, so at batch 64-128 a prompt token costs what a prefilled one does.

A prefix every prompt repeats (a chat template's default system prompt: ~20 of SmolLM2's ~94-token MT-bench and
GSM8K prompts) is computed once (`share_prefix`); a row restarting on it copies its keys and values instead of
feeding it again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from draftsmith.backends.batch import PreallocatedLayer, batch_cache, left_padded, prefill
from draftsmith.target import Target


class RowSlotsLayer(PreallocatedLayer):
    """A preallocated KV layer whose decode steps write each row at its own slot (`slots`, set by the decoder).

    The prefill writes every row from slot 0, as `PreallocatedLayer` does. After it, rows are no longer aligned: a
    row that restarted writes from slot 0 again while the others go on. Attention reads slots [0, `width`) and the
    decoder's mask says which of them each row may see.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.slots: torch.Tensor | None = None  # (rows,) the slot each row's next token goes to
        self.width = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slots is None:  # the prefill
            keys, values = super().update(key_states, value_states)
            self.width = self.length
            return keys, values
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        self._keys[rows, :, self.slots] = key_states[:, :, 0]
        self._values[rows, :, self.slots] = value_states[:, :, 0]
        return self._keys[:, :, : self.width], self._values[:, :, : self.width]

    def write_prefix(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy one sequence's keys and values, (1, kv heads, length, dim), into slots [0, length) of `rows`."""
        self._keys[rows, :, : keys.shape[-2]] = keys
        self._values[rows, :, : values.shape[-2]] = values

    def grow(self, capacity: int) -> None:
        extra = capacity - self._keys.shape[-2]
        if extra > 0:
            self._keys, self._values = F.pad(self._keys, (0, 0, 0, extra)), F.pad(self._values, (0, 0, 0, extra))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]


def streamable(model) -> bool:
    """Whether `StreamDecoder` can run `model`: every layer plain full attention (no sliding window, no linear
    attention), whose KV cache it lays out itself."""
    return all(type(layer) is PreallocatedLayer for layer in batch_cache(model, 1).layers)


class StreamDecoder:
    """Rows of one token per step each, every row at its own place in its own sequence.

    Construction prefills the first prompts (left-padded); `logits` holds each row's next-token logits. `step`
    feeds one token per row; rows listed in `restart` begin a new sequence with that token (their earlier slots are
    masked out and positions start again at 0). `keep` drops rows that have nothing left to write. Callers hold
    `torch.inference_mode()` and `batched_attention(model)` around its whole life.
    """

    def __init__(self, target: Target, prompts: Sequence[list[int]], capacity: int) -> None:
        self.model, device = target.model, target.device
        ids = left_padded(target, prompts)
        width = ids.shape[1]
        capacity = max(capacity, width + 1)
        self.attend = torch.zeros(len(prompts), capacity, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            self.attend[i, width - len(p) : width] = True
        self.cache = Cache(layers=[RowSlotsLayer(capacity) for _ in batch_cache(self.model, 1).layers])
        self.logits = prefill(self.model, ids, self.attend[:, :width], self.cache)
        self.slots = torch.full((len(prompts),), width, dtype=torch.long, device=device)
        self.positions = torch.tensor([len(p) for p in prompts], device=device)
        self.width = width  # slots [0, width) hold or held some row's tokens
        # Lower precisions read the whole buffer (masked): CPU bf16 matmuls copy a strided view first (see
        # `PreallocatedLayer`); float32 reads the used part in place.
        self.whole = self.model.dtype != torch.float32
        self.prefix: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, (1, kv heads, prefix, dim) each

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def prefix_length(self) -> int:
        return self.prefix[0][0].shape[-2] if self.prefix else 0

    def share_prefix(self, tokens: Sequence[int]) -> None:
        """Run `tokens` once, alone, and keep their keys and values for the rows `step` restarts on them."""
        ids = torch.tensor([list(tokens)], device=self.slots.device)
        cache = batch_cache(self.model, ids.shape[1])
        prefill(self.model, ids, torch.ones_like(ids, dtype=torch.bool), cache)
        self.prefix = [(layer.keys, layer.values) for layer in cache.layers]

    def step(self, tokens: Sequence[int], restart: Sequence[int] = (), shared: Sequence[int] = ()) -> torch.Tensor:
        """Feed `tokens` (one per row); the logits of the token after each, (rows, vocab). Rows in `restart` begin a
        new sequence with their token; rows in `shared` begin one after the shared prefix (`share_prefix`)."""
        if restart or shared:
            index = torch.tensor([*restart, *shared], device=self.slots.device)
            self.attend[index] = False
            self.slots[index] = 0
            self.positions[index] = 0
        if shared:
            index, length = torch.tensor(shared, device=self.slots.device), self.prefix_length
            for layer, (keys, values) in zip(self.cache.layers, self.prefix, strict=True):
                layer.write_prefix(index, keys, values)
            self.attend[index, :length] = True
            self.slots[index] = length
            self.positions[index] = length
        rows = torch.arange(self.rows, device=self.slots.device)
        self.width = max(self.width, int(self.slots.max()) + 1)
        if self.width > self.attend.shape[1]:  # a sequence longer than the capacity: grow every buffer
            capacity = max(self.width, 2 * self.attend.shape[1])
            self.attend = F.pad(self.attend, (0, capacity - self.attend.shape[1]))
            for layer in self.cache.layers:
                layer.grow(capacity)
        self.attend[rows, self.slots] = True
        span = self.attend.shape[1] if self.whole else self.width
        for layer in self.cache.layers:
            layer.slots, layer.width = self.slots, span
        out = self.model(
            input_ids=torch.tensor(tokens, device=self.slots.device)[:, None],
            attention_mask=self.attend[:, None, None, :span],
            position_ids=self.positions[:, None],
            past_key_values=self.cache,
            logits_to_keep=1,
        )
        self.slots, self.positions = self.slots + 1, self.positions + 1
        self.logits = out.logits[:, -1].float()
        return self.logits

    def keep(self, live: Sequence[int]) -> None:
        """Keep only the rows at these indices, in this order."""
        index = torch.tensor(live, dtype=torch.long, device=self.slots.device)
        for layer in self.cache.layers:
            layer.batch_select_indices(index)
        self.attend, self.slots, self.positions = self.attend[index], self.slots[index], self.positions[index]
        self.logits = self.logits[index]
