"""The attention every CPU target runs (`load_target`) and every batched generation (`backends/batch.py`): SDPA with
grouped-query attention inside the kernel, registered with transformers as `ATTENTION`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from draftsmith.native import native_kernel

ATTENTION = "draftsmith_gqa"

LOW_PRECISION = (torch.bfloat16,)  # the cache dtypes whose decode attention the native kernel serves


def masked_gqa_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA with grouped-query attention done inside the kernel, padding or tree mask or not: every CPU target's
    attention and every batched generation's.

    transformers' own SDPA path copies every key/value head `num_key_value_groups` times whenever a mask is present
    (always, in a left-padded batch or a verify forward): on a CPU that copy took ~30 % of each batched decode step,
    and for one sequence SDPA with the heads grouped costs 114 against 156 us a SmolLM2 layer over 16 new tokens
    (87 against 146 over 5). One sequence's mask (a draft tree's additive one, or none) goes to SDPA as it is: every
    row sees itself, and a single row is faster there than in `_decode_attention` (28 against 45 us at 150 tokens
    of context). In a batch, query rows that see nothing at all (left padding) attend everywhere instead of
    producing NaN (their outputs are never used), and a batch of single rows (decode steps) goes to
    `_decode_attention`.
    """
    one_row = query.shape[2] == 1
    if query.shape[0] == 1 and not (one_row and query.dtype in LOW_PRECISION):
        causal = attention_mask is None and not one_row  # no mask: a prefill from an empty cache (causal is top-left)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    mask = attention_mask
    if mask is not None:
        mask = mask if mask.dtype == torch.bool else mask == 0
    if one_row:
        return _decode_attention(query, key, value, mask, scaling), None
    if mask is not None:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _decode_attention(query, key, value, mask, scaling):
    """One query row per sequence (a decode step) as two batched matmuls, the query heads that share a key/value
    head stacked as rows. CPU SDPA's flash kernel spends most of its time on tiling that a single row does not
    need: at batch 32 and 300 tokens of context it was ~40 % of a SmolLM2 decode step, this is a few percent.

    A bf16 cache on a CPU goes to `kernels/decode_attention.cpp` instead: torch's bf16 batched matmuls
    over these tiny products read the cache at ~7 GB/s, the kernel reads each key and value row once, skipping
    masked slots (`benchmarks/decode_step_profile.py --attention kernel,torch`)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    fits = query.dtype in LOW_PRECISION and query.device.type == "cpu" and dim in (64, 128) and heads <= 4 * kv_heads
    kernel = native_kernel("decode_attention") if fits else None
    if kernel is not None:
        if mask is None:
            mask = torch.ones(batch, 1, 1, key.shape[2], dtype=torch.bool)
        seen = mask.expand(batch, 1, 1, -1)[:, 0, 0]
        return kernel.decode_attention(query.reshape(batch, heads, dim), key, value, seen, scale)[:, None]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale
    if mask is not None:  # (batch, 1, 1, context): True where a row may look
        scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, -1), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)
    return out.reshape(batch, 1, heads, dim)


AttentionInterface.register(ATTENTION, masked_gqa_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the same boolean masks SDPA gets
