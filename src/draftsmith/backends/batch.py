"""Batched generation on a transformers target: a left-padded batch whose finished rows leave it, written into a
preallocated KV cache in place (the default engine of `data/regenerate` and `data/synth`, via the transformers
backend)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from draftsmith.attention import ATTENTION
from draftsmith.target import Target


@contextmanager
def batched_attention(model):
    """Use `attention.masked_gqa_attention` for the duration of a batched generation (a CPU target does anyway;
    `load_target`), then restore the model's own."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


class PreallocatedLayer(DynamicLayer):
    """A KV cache layer written in place into a buffer sized once for the whole generation.

    `DynamicLayer` grows by `torch.cat`, which copies the whole cache of every layer on every decode step: at batch
    32 and a few hundred tokens of context that copy is a tenth to a quarter of the step, and it grows with the
    context. Here a step writes only its new keys and values; attention reads a view of the used part. Rows that
    leave the batch are compacted once, when they leave.

    `whole`: a decode step (one new token) gets the whole zero-initialised buffer instead of the used part, and the
    caller masks the unwritten slots. The used part of a (batch, heads, capacity, dim) buffer is a strided view, and
    CPU bf16 matmuls copy such a view to a contiguous one first: at batch 64 and 512 tokens of context that made
    attention 4.5 ms a layer against 1.3 ms over the whole buffer. float32 matmuls read the view in place (there the
    used part alone is faster), so `BatchDecoder` asks for it for lower precisions only.
    """

    def __init__(self, capacity: int, whole: bool = False) -> None:
        super().__init__()
        self.capacity = capacity
        self.whole = whole
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, _ = key_states.shape
        # zeros, not garbage: with `whole`, unwritten slots are read (and masked), and 0 * NaN would still be NaN
        self._keys = key_states.new_zeros(batch, heads, self.capacity, key_states.shape[-1])
        self._values = value_states.new_zeros(batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:  # never when the capacity was sized right; grow rather than fail
            grow = max(end, 2 * self._keys.shape[-2]) - self._keys.shape[-2]
            self._keys = F.pad(self._keys, (0, 0, 0, grow))
            self._values = F.pad(self._values, (0, 0, 0, grow))
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        if self.whole and end - start == 1 and start > 0:  # a decode step (a one-token prompt's prefill is not)
            return self._keys, self._values
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            n, end = len(indices), self.length
            self._keys[:n, :, :end] = self._keys[indices, :, :end]  # the right side is a copy: no overlap hazard
            self._values[:n, :, :end] = self._values[indices, :, :end]
            self._keys, self._values = self._keys[:n], self._values[:n]
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]


def batch_cache(model, capacity: int, whole: bool = False) -> Cache:
    """A cache of `PreallocatedLayer`s holding `capacity` tokens per row, or transformers' own `DynamicCache` for
    models whose layers are not all plain full-attention layers (sliding windows, linear attention, ...)."""
    dynamic = DynamicCache(config=model.config)
    if not dynamic.layers or any(type(layer) is not DynamicLayer for layer in dynamic.layers):
        return dynamic
    return Cache(layers=[PreallocatedLayer(capacity, whole) for _ in dynamic.layers])


def pad_id(target: Target) -> int:
    """The token padding rows that hold nothing: the pad token, else the first EOS id."""
    pad = target.tokenizer.pad_token_id
    return min(target.eos_token_ids) if pad is None else pad


def left_padded(target: Target, prompts: Sequence[list[int]]) -> torch.Tensor:
    """The prompts as one (rows, longest) id tensor, left-padded with `pad_id`."""
    width = max(len(p) for p in prompts)
    pad = pad_id(target)
    return torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=target.device)


def prefill(model, ids: torch.Tensor, attend: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Forward left-padded `ids` into `cache`, each row seeing the slots where `attend` (rows, width) is True and
    counting positions from its first real token; the next-token logits of each row, float32."""
    out = model(
        input_ids=ids,
        attention_mask=attend.long(),
        position_ids=(attend.long().cumsum(-1) - 1).clamp_min(0),
        past_key_values=cache,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


class BatchDecoder:
    """A left-padded batch decoded one token per live row per step, into a preallocated KV cache.

    Construction runs the prefill (`logits` then holds each row's next-token logits); `step` feeds one token per
    live row and returns the next logits; `keep` drops the rows that are done (their cache rows go). Callers hold
    `torch.inference_mode()` and `batched_attention(model)` around its whole life.
    """

    def __init__(
        self, target: Target, prompts: Sequence[list[int]], max_new_tokens: int, whole: bool | None = None
    ) -> None:
        """`whole`: decode steps read the whole KV buffer (`PreallocatedLayer`); None: for dtypes below float32."""
        self.model, device = target.model, target.device
        ids = left_padded(target, prompts)
        self.width = width = ids.shape[1]
        self.lengths = [len(p) for p in prompts]
        # Which cache slots each row attends to (True = a real token), for the whole generation at once.
        self.attend = torch.ones(len(prompts), width + max_new_tokens, dtype=torch.bool, device=device)
        for i, n in enumerate(self.lengths):
            self.attend[i, : width - n] = False
        self.positions = torch.tensor([[max(n - 1, 0)] for n in self.lengths], device=device)
        self.rows = list(range(len(prompts)))  # original index of each live row
        whole = self.model.dtype != torch.float32 if whole is None else whole
        self.cache = batch_cache(self.model, width + max_new_tokens, whole)
        # A decode step reads the whole buffer when the cache hands it out: then it always needs the mask, with the
        # slots not yet written masked out (`step` unmasks one per step).
        self.whole = all(getattr(layer, "whole", False) for layer in self.cache.layers)
        if self.whole:
            self.attend[:, width:] = False
        self.padded = min(self.lengths) < width
        self.seen = width  # cache slots written so far
        self.logits = prefill(self.model, ids, self.attend[:, :width], self.cache)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row (shape (rows,)); the logits of the token after it, (rows, vocab)."""
        self.positions = self.positions + 1
        self.seen += 1
        if self.whole:
            self.attend[:, self.seen - 1] = True
            mask = self.attend[:, None, None, :]
        else:
            mask = self.attend[:, None, None, : self.seen] if self.padded else None
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            logits_to_keep=1,
        )
        self.logits = out.logits[:, -1].float()
        return self.logits

    def keep(self, live: list[int]) -> torch.Tensor:
        """Keep only the live rows at these indices (into the current rows); the index tensor, to select with."""
        index = torch.tensor(live, device=self.attend.device)
        for layer in self.cache.layers:
            layer.batch_select_indices(index)
        self.rows, self.positions, self.attend = [self.rows[i] for i in live], self.positions[index], self.attend[index]
        self.padded = min(self.lengths[r] for r in self.rows) < self.width
        return index


def choose(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The next token of each row: argmax at T=0, else a sample at `temperature` (global torch RNG)."""
    if temperature > 0:
        return sample(logits if temperature == 1 else logits / temperature)
    return logits.max(-1).indices  # argmax's first maximum too: 2.0 against 7.7 ms at 128 x 49,152 on CPU


SAMPLE_BLOCK = 256


def sample(logits: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from softmax(`logits`), by inverting the CDF with two uniforms: a block of
    `SAMPLE_BLOCK` tokens by the blocks' masses, then a token inside it by its share of the block's.

    Why: `torch.multinomial` on a CPU draws per vocabulary entry, ~117 ms for 100 rows x 49,152 on 2 cores, and
    sampling the user turns took 18 % of a recorded self-chat batch (measurements log); this is ~20 ms. Why blocks:
    a float32 running sum over the whole vocabulary resolves probabilities only to ~6e-8 of the total, so tokens
    below that would be merged with their neighbours; inside a block the resolution is relative to the block's
    mass, and the blocks' sums run in float64. Zero-probability tokens are never drawn (`right=True`)."""
    probs = torch.softmax(logits, dim=-1)
    rows, vocab = probs.shape
    padded = probs if vocab % SAMPLE_BLOCK == 0 else F.pad(probs, (0, -vocab % SAMPLE_BLOCK))
    within = padded.view(rows, -1, SAMPLE_BLOCK).cumsum(-1)  # running sums inside each block
    ends = within[:, :, -1].double().cumsum(-1)
    u = torch.rand(rows, 2, dtype=torch.float64, device=probs.device)
    block = torch.searchsorted(ends, u[:, :1] * ends[:, -1:], right=True).clamp_max(ends.shape[1] - 1)
    inside = within[torch.arange(rows, device=probs.device), block[:, 0]].double()
    token = torch.searchsorted(inside, u[:, 1:] * inside[:, -1:], right=True).clamp_max(SAMPLE_BLOCK - 1)
    return (block * SAMPLE_BLOCK + token)[:, 0].clamp_max(vocab - 1)


def generate_batch(
    target: Target, prompts: Sequence[list[int]], *, temperature: float, max_new_tokens: int, stop_ids: set[int]
) -> list[tuple[list[int], bool]]:
    """(new tokens without the stop token, whether a stop token ended them) for each prompt, in one left-padded batch.

    A plain decode loop rather than `model.generate`, because a row that has stopped leaves the batch (its KV cache
    rows are dropped) instead of being computed until the longest row ends: synthesised prompts vary from 10 to
    100+ tokens. Sampling uses the global torch RNG, so callers seed it; T=0 is greedy.

    What a decode step costs besides the forward itself, and what this loop does about it (counted with
    torch.profiler at batch 32 on SmolLM2-135M, 30 layers): the forward is 211 linear calls (7 per layer and the
    LM head over the full 49,152-token vocabulary), 30 attention calls and ~1,300 small ops (norms, RoPE, SwiGLU).
    Around it, transformers' `DynamicCache` re-copied the whole KV cache with 60 `torch.cat`s per step (now a cache
    written in place: `PreallocatedLayer`), and the 2-D padding mask was grown by a `cat` and rebuilt into a 4-D mask
    every step (now one boolean buffer, viewed, and no mask at all when no row is padded). The rest per step is one
    argmax (or `sample` when sampling) over (rows, vocab) and one `tolist()` to decide which rows stop.
    """
    new: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    with torch.inference_mode(), batched_attention(target.model):
        decoder = BatchDecoder(target, prompts, max_new_tokens)
        for step in range(max_new_tokens):
            chosen = choose(decoder.logits, temperature)
            keep = []
            for i, token in enumerate(chosen.tolist()):
                if token in stop_ids:
                    ended[decoder.rows[i]] = True
                else:
                    new[decoder.rows[i]].append(token)
                    keep.append(i)
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) < len(decoder.rows):
                chosen = chosen[decoder.keep(keep)]
            decoder.step(chosen)
    return list(zip(new, ended, strict=True))
