"""EAGLE-3 (Li et al., 2025): a one-layer drafter that reads the target's own hidden states.

The model, as SGLang, vLLM and speculators lay it out (parameter names map 1:1 onto theirs):

    fc          Linear(3H -> H): fuses the target's states entering three layers (low, middle, high) into h
    midlayer    one Llama decoder layer whose q/k/v read cat(input_layernorm(embed(token)), hidden_norm(h)),
                width 2H; the residual stream is h itself
    norm, lm_head   final RMSNorm and a head over the *draft* vocabulary (d2t maps draft ids to target ids)

One step takes (embedding of token x[t+1], hidden h_t) at position t and returns the pre-norm output hidden, which
becomes the h of the next step, and draft logits for the token after x[t+1]. Over the context h_t is fc(target
features at t); while drafting it is the drafter's own previous output. `Eagle3Drafter` runs that loop behind the
engine's drafter protocol; training unrolls the same loop (train/losses.py) and a test proves the two agree.

Layer variants, as speculators 0.9.0 names them (`Eagle3Config`; all off is the layer above, and what SGLang runs):
`norm_before_fc` (one RMSNorm `input_norm` over the 3H features before fc), `fc_norm` (one RMSNorm per aux layer,
`fc_norm.i`), `norm_before_residual` (the residual is hidden_norm(h)), `norm_output` (the output hidden is normed
by `norm` and carried to the next step *normed*; lm_head reads it as is), `qk_norm` (Qwen3's layer: per-head q/k
RMSNorm) and `sliding_window` W (a query sees the last W context positions; in training, as in speculators, the
window is anchored at the context position a TTT step drafts from, at inference at the query's own position, as
an engine's sliding window is: the two differ only for contexts longer than W - k).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import save_file
from torch import nn

from draftsmith.decode.tree import TreeShape
from draftsmith.decode.tree import depths as tree_depths
from draftsmith.drafters.base import Draft
from draftsmith.drafters.budget import DraftBudget, node_confidences
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.packed import can_quantize, pack_linears, quantize_linears
from draftsmith.store import default_aux_layers
from draftsmith.target import Target

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FROZEN = ("embed_tokens.weight",)  # a copy of the target's embeddings: restored from the target, never saved
# The layer variants speculators 0.9.0 can describe, as `Eagle3Config` fields (all off: the original EAGLE-3 layer).
# How an EAGLE-3 drafter's weights are held while it drafts (`Eagle3Drafter`); auto: int8 where it can be (a float32
# drafter on a CPU), else float32
PRECISIONS = ("auto", "float32", "int8")
VARIANTS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "qk_norm", "sliding_window")


def layer_shape(target: Target, algorithm: str) -> dict[str, Any]:
    """A drafter layer shaped like one of the target's: sizes, heads, norm epsilon, plain RoPE (anything else is
    refused), context and vocabulary — the config fields EAGLE-3 and DFlash share."""
    c = target.config
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"target {target.name} uses {rope['rope_type']!r} RoPE scaling; the {algorithm} drafter supports plain "
            "RoPE only",
            hint="use a target without rope scaling",
        )
    heads = c.num_attention_heads
    return {
        "hidden_size": c.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
        "max_position_embeddings": target.context_length,
        "vocab_size": target.vocab_size,
    }


class Eagle3Config(BaseModel):
    """Everything needed to rebuild the drafter, and which target it belongs to (saved as config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    target: str = ""
    target_fingerprint: str = ""
    # Layer variants, named as speculators' Eagle3SpeculatorConfig names them; a config.json without them (every
    # draftsmith checkpoint written before they existed) reads as the original layer.
    norm_before_fc: bool = False  # RMSNorm `input_norm` (3H) over the concatenated target features before fc
    fc_norm: bool = False  # one RMSNorm per aux layer, `fc_norm.{0,1,2}` (H), over its features before fc
    norm_before_residual: bool = False  # the attention residual is hidden_norm(h), not h
    norm_output: bool = False  # the output hidden is `norm`ed before lm_head *and* carried to the next step normed
    qk_norm: bool = False  # Qwen3's layer: RMSNorm over each head of q and k before RoPE (`q_norm`, `k_norm`)
    sliding_window: int | None = Field(default=None, ge=1)  # attend to the last W context positions only

    @model_validator(mode="after")
    def _one_fc_norm(self) -> Eagle3Config:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other (one norm over 3H, or one per layer)")
        return self

    def variant(self) -> dict[str, Any]:
        """The layer variant switches that are not at their default (empty for the original EAGLE-3 layer)."""
        defaults = type(self).model_fields
        return {k: getattr(self, k) for k in VARIANTS if getattr(self, k) != defaults[k].default}

    @classmethod
    def from_target(
        cls,
        target: Target,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...],
        fingerprint: str | None = None,
        intermediate_size: int | None = None,
        **variant: Any,
    ) -> Eagle3Config:
        """Shape the drafter's layer like one of the target's (`intermediate_size` widens or narrows its MLP);
        `fingerprint` skips re-hashing a known target; `variant` sets the layer variant switches (`VARIANTS`)."""
        if len(aux_layer_ids) != 3 or not all(0 <= i < target.num_layers for i in aux_layer_ids):
            raise ConfigError(
                f"EAGLE-3 needs 3 aux layer ids in [0, {target.num_layers}), got {tuple(aux_layer_ids)}",
                hint=f"use the default {default_aux_layers(target.num_layers)} for {target.name}",
            )
        if not 0 < draft_vocab_size <= target.vocab_size:
            raise ConfigError(
                f"draft vocabulary size {draft_vocab_size} is outside 1..{target.vocab_size} (the target's)",
                hint="pick a draft vocabulary no larger than the target's",
            )
        unknown = sorted(set(variant) - set(VARIANTS))
        if unknown:
            raise ConfigError(f"unknown EAGLE-3 layer variant {unknown}", hint=f"use {', '.join(VARIANTS)}")
        if variant.get("norm_before_fc") and variant.get("fc_norm"):
            raise ConfigError(
                "norm_before_fc and fc_norm exclude each other (one norm over the 3 layers, or one per layer)",
                hint="turn one of them off",
            )
        shape = layer_shape(target, "EAGLE-3")
        if intermediate_size is not None:
            shape["intermediate_size"] = intermediate_size
        return cls(
            **shape,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids),
            target=target.name,
            target_fingerprint=target.fingerprint() if fingerprint is None else fingerprint,
            **variant,
        )


class AttentionCache(Protocol):
    """Decides which keys a query sees: `attend` stores this call's keys/values and returns the attention output.
    A sliding-window layer passes `window`: then context keys more than `window - 1` positions back are hidden."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor: ...


class KVCache:
    """Inference cache: keys/values of every position run so far, in order; roll back with `crop`."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, kv_heads, S, head_dim), RoPE applied
        self.v: torch.Tensor | None = None
        # Tree drafting sets the (new, total) bool visibility of the next call's queries (its tree mask); None: causal.
        self.visible: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        past = len(self)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        new, total = q.shape[2], self.k.shape[2]
        if self.visible is not None:
            mask, self.visible = self.visible.to(q.device), None
            return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=True)
        if new == 1 and (window is None or window >= total):  # a draft step: the one query sees the whole cache
            return F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=True)
        # The i-th new query sits at cache index past + i and sees everything up to and including itself (within
        # the window: the last `window` cache entries, as an engine's sliding window over positions does).
        seen = torch.arange(total, device=q.device)[None, :]
        at = past + torch.arange(new, device=q.device)[:, None]
        mask = (seen <= at) if window is None else (seen <= at) & (seen > at - window)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=True)

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Plain causal attention of T queries over their T keys, or with `window` over the last `window` of them."""
    length = q.shape[2]
    if window is None or window >= length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(length, window, q.device), enable_gqa=True)


def band_mask(length: int, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """(L, L) bool: query t sees keys s with t - window < s <= t (speculators' sliding causal mask)."""
    t = torch.arange(length, device=device)[:, None]
    s = torch.arange(length, device=device)[None, :]
    return (s <= t) if window is None else (s <= t) & (s > t - window)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like Llama, so bf16 training and fp32 inference see the same statistics.
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half layout) for cos/sin of shape (T, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, head_dim) for `positions` (T,), on `like`'s device and dtype. The angles are computed in fp32
    whatever the model's dtype, as Llama and Qwen3 compute them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=like.device).float() / head_dim)
    angles = positions.to(like.device, torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3's layer: each head of q and k RMS-normed (over head_dim) before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.window = cfg.sliding_window

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is None:
            out = causal_attention(q, k, v, self.window)
        else:
            out = cache.attend(q, k, v) if self.window is None else cache.attend(q, k, v, window=self.window)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The decoder layer: attention over [token embedding ; hidden], with the hidden (or, with
    `norm_before_residual`, the normed hidden) as the residual."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = (normed if self.norm_before_residual else hidden) + self.self_attn(x, cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        if config.norm_before_fc:  # speculators' names for its norms before fc (absent when off)
            self.input_norm = RMSNorm(3 * h, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @classmethod
    def from_weights(
        cls,
        config: Eagle3Config,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
    ) -> Eagle3Model:
        """A fresh drafter: the target's embeddings (frozen) and its head rows for the draft vocabulary."""
        model = cls(config)
        model.set_vocab(d2t, t2d)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed_weight)
            rows = model.draft_to_target(torch.arange(config.draft_vocab_size))
            model.lm_head.weight.copy_(head_weight[rows.to(head_weight.device)])
        return model

    @torch.no_grad()
    def start_from_logit_lens(self, final_norm_weight: torch.Tensor) -> None:
        """Start as the target's "logit lens" on its deepest aux layer: fc passes that layer's state through, the
        decoder layer's attention and MLP outputs start at zero (so the layer is the identity) and `norm` is the
        target's final norm. The untrained drafter then predicts lm_head(norm(h_high)), which agrees with the
        target's next token far more often than a random start (RMSNorm ignores the state's scale), and training
        has less to learn from little data. The other weights keep their random init, so nothing is stuck at zero
        once the outputs move."""
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * h :] = torch.eye(h, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
        self.midlayer.self_attn.o_proj.weight.zero_()
        self.midlayer.mlp.down_proj.weight.zero_()
        self.norm.weight.copy_(final_norm_weight)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary, checking that d2t and t2d describe the same set of target tokens."""
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if tuple(d2t.shape) != (vd,) or tuple(t2d.shape) != (v,):
            raise DraftsmithError(
                f"draft vocabulary has d2t {tuple(d2t.shape)} and t2d {tuple(t2d.shape)}, expected ({vd},) and ({v},)",
                hint="build the draft vocabulary for this target with the configured draft vocabulary size",
            )
        ids = torch.arange(vd) + d2t.long().cpu()
        t2d = t2d.bool().cpu()
        if ids.min() < 0 or ids.max() >= v or len(ids.unique()) != vd or not t2d[ids].all() or int(t2d.sum()) != vd:
            raise DraftsmithError(
                "d2t and t2d disagree: d2t must map the draft ids onto exactly the target tokens t2d marks",
                hint="rebuild the draft vocabulary (`draftsmith vocab`)",
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(..., 3H) target features -> (..., H): the hidden a context position starts from."""
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.config.fc_norm:
            parts = aux_hidden.chunk(3, dim=-1)
            aux_hidden = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: AttentionCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden (B, T, H) at `positions` (T,) -> (output hidden (B, T, H), draft logits (B, T, Vd)).

        Without a cache the T positions attend causally among themselves (a plain forward over a context).
        """
        out = self.forward_hidden(embeds, hidden, positions, cache)
        return out, self.draft_logits(out)

    def forward_hidden(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        """The output hidden alone: training computes logits only at the positions that reach the loss.

        It is what the next draft step reads as its hidden: the layer's output, or with `norm_output` its `norm`.
        """
        cfg = self.config
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, embeds)
        out = self.midlayer(embeds, hidden, cos, sin, cache)
        return self.norm(out) if cfg.norm_output else out

    def draft_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The normed state the head reads from an output hidden of `forward_hidden` (already normed with
        `norm_output`): the drafter's guess at the target's final normed hidden state one position on."""
        return hidden if self.config.norm_output else self.norm(hidden)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.draft_state(hidden))


class Eagle3Drafter:
    """The drafter protocol over an `Eagle3Model`, with its own KV cache.

    Context position t is run once, from (embed(tokens[t+1]), fc(features[t])), as soon as both are known. A draft
    continues from the last context position with the drafter's own hidden states; those positions are cropped
    off again, because once the target confirms them they are recomputed from the target's real features.
    """

    def __init__(
        self,
        model: Eagle3Model,
        name: str = "eagle3",
        budget: DraftBudget | None = None,
        tree: TreeShape | None = None,
        precision: str = "float32",
    ) -> None:
        """`precision` int8: the drafter's linears in int8 on a CPU (`packed.Int8Linear`: a quarter of the bytes its
        memory-bound steps read; 2.4x faster steps on an AVX2 EPYC); float32: packed for oneDNN like the target's;
        auto: int8 where `can_quantize`, else float32. A model already swapped keeps its layout (a twin sharing the
        weights drafts as they do)."""
        self.name = name
        self.model = model.eval()
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown drafter precision {precision!r}", hint=f"use {', '.join(PRECISIONS)}")
        if precision == "auto":
            precision = "int8" if can_quantize(model) else "float32"
        self.precision = precision
        if precision == "int8":
            quantize_linears(model)
        else:
            pack_linears(model)  # its steps are memory-bound one-row forwards, like the target's
        self.budget = budget or DraftBudget.fixed()
        if tree is not None:
            tree.check_vocab(model.config.draft_vocab_size)
        self.tree = tree  # draft EAGLE-2 trees of this shape (an adaptive budget cuts them); None: chains
        self.last_chain: tuple[int, list[int], list[float]] | None = None  # (start, tokens, confidences) to score
        self.last_tree: tuple[int, list[int], list[int], list[float]] | None = None  # (start, tokens, parents, conf.)
        self.aux_layer_ids: tuple[int, ...] = tuple(model.config.aux_layer_ids)
        self.draft_ids = model.draft_to_target(torch.arange(model.config.draft_vocab_size, device=model.d2t.device))
        self.begin(torch.empty(0, dtype=torch.long), None)

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        self.cache = KVCache()
        self.last_chain = self.last_tree = None
        self.fused = torch.empty(0, self.model.config.hidden_size, device=self.device, dtype=self.model.fc.weight.dtype)
        self.pending: list[torch.Tensor] = []  # target features not yet fused: fc runs once over all of them
        self.context = 0  # context positions in the cache
        self.hidden: torch.Tensor | None = None  # (1, 1, H) output hidden of the last context position
        self.logits: torch.Tensor | None = None  # (Vd,) its draft logits
        if features is not None:
            self._append(features)

    def _append(self, features: torch.Tensor) -> None:
        self.pending.append(features)

    def _fuse_pending(self) -> None:
        if self.pending:
            features = torch.cat(self.pending).to(self.device, self.fused.dtype)
            self.fused = torch.cat([self.fused, self.model.fuse(features)])
            self.pending = []

    @torch.inference_mode()
    def propose(self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator) -> Draft:
        """`tokens` extends the tokens of the previous call; runs new context positions, then drafts a chain."""
        model = self.model
        if max_tokens < 1 or self.budget.resting():
            return Draft.empty()
        self._fuse_pending()
        ready = min(len(self.fused), len(tokens) - 1)  # positions whose (feature, next token) pair is known
        if ready < 1:
            return Draft.empty()
        self.cache.crop(self.context)
        if ready > self.context:
            embeds = model.embed_tokens(tokens[self.context + 1 : ready + 1].to(self.device))[None]
            positions = torch.arange(self.context, ready, device=self.device)
            out = model.forward_hidden(embeds, self.fused[None, self.context : ready], positions, self.cache)
            self.hidden, self.context = out[:, -1:], ready
            self.logits = model.draft_logits(self.hidden)[0, -1]  # only the last position drafts
        if self.tree is not None:
            self._score_last_tree(tokens)
            return self._tree_draft(len(tokens), max_tokens)
        self._score_last_chain(tokens)
        hidden, logits = self.hidden, self.logits
        drafted, dists, reach, confidences = [], [], [1.0], []
        for i in range(max_tokens):
            token, q, confidence = self._pick(logits, temperature, generator)
            reach.append(self.budget.reach(reach[-1], confidence))
            if not self.budget.continues(reach[-1], len(drafted)):
                break
            drafted.append(token)
            dists.append(q)
            confidences.append(confidence)
            if i + 1 < max_tokens:
                embeds = model.embed_tokens(token.view(1, 1))
                position = torch.tensor([self.context + i], device=self.device)
                hidden, out_logits = model(embeds, hidden, position, self.cache)
                logits = out_logits[0, -1]
        expected = sum(reach[1 : len(drafted) + 1])
        self.budget.settle(bool(drafted) and self.budget.pays(expected, len(drafted)))  # rest when drafting is a loss
        if not drafted:
            return Draft.empty()
        self.last_chain = (len(tokens), torch.stack(drafted).tolist(), confidences)
        keep = self.budget.best_length(reach[1 : len(drafted) + 1])
        if keep == 0:
            return Draft.empty()
        probs = torch.stack(dists[:keep]).cpu() if temperature > 0 else None
        return Draft(torch.stack(drafted[:keep]).cpu(), probs)

    def _tree_draft(self, start: int, max_tokens: int) -> Draft:
        """Grow a tree and verify the part the budget chooses (`DraftBudget.choose_tree`)."""
        tokens, parents, scores = self.grow_tree(max_tokens)
        flat_parents = parents.tolist()
        steps = int(tree_depths(parents).max())
        total = min(self.tree.total, max_tokens)
        keep, confidences = self.budget.choose_tree(flat_parents, scores.tolist(), total, steps)
        if not self.budget.is_fixed:
            self.last_tree = (start, tokens.tolist(), flat_parents, confidences)  # scored on the next call
        return Draft.from_tree(tokens, flat_parents, keep)

    @torch.inference_mode()
    def grow_tree(self, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's dynamic tree from the last context position: (target token ids, parents, cumulative draft
        log-probabilities) of all the nodes grown, in topological order, siblings best first.

        The root's top-k children form the first frontier; then up to `depth - 1` times the frontier runs in one
        forward under the tree mask (each node sees the context, its ancestors and itself), each of its nodes gets
        its top-k children, and the top-k of those by cumulative log-probability become the next frontier. An
        adaptive budget stops growing once the best frontier node's chance of acceptance no longer pays for a
        drafter step. Children are deterministic picks (point masses), which sampling verification handles by
        removing each rejected one from the target's distribution (decode/tree.py)."""
        model, shape = self.model, self.tree
        depth, total = min(shape.depth, max_tokens), min(shape.total, max_tokens)
        scores, ids = torch.log_softmax(self.logits.float(), -1).topk(min(shape.topk, total))
        node_scores, node_ids, parents = [scores], [ids], [torch.full_like(ids, -1)]
        slots = [-1] * len(ids)  # drafter cache index of each node run so far (-1: not run)
        frontier = torch.arange(len(ids), device=ids.device)
        frontier_hidden = self.hidden.expand(1, len(ids), -1)
        for level in range(1, depth):
            flat_parents = torch.cat(parents).tolist()
            if not self._worth_growing(flat_parents, torch.cat(node_scores), frontier.tolist(), total):
                break
            first = len(self.cache)
            visible = torch.zeros(len(frontier), first + len(frontier), dtype=torch.bool)
            visible[:, : self.context] = True
            if model.config.sliding_window is not None:
                visible[:, : max(0, self.context + level - model.config.sliding_window)] = False
            for row, node in enumerate(frontier.tolist()):
                slots[node] = first + row
                while node >= 0:
                    visible[row, slots[node]] = True
                    node = flat_parents[node]
            self.cache.visible = visible
            embeds = model.embed_tokens(self.draft_ids[torch.cat(node_ids)[frontier]])[None]
            positions = torch.full((len(frontier),), self.context + level - 1, device=self.device)
            out, logits = model(embeds, frontier_hidden, positions, self.cache)
            logp = torch.log_softmax(logits[0].float(), -1)
            child_scores, child_ids = (torch.cat(node_scores)[frontier, None] + logp).topk(shape.topk, dim=-1)
            base = sum(len(x) for x in node_ids)
            node_scores.append(child_scores.flatten())
            node_ids.append(child_ids.flatten())
            parents.append(frontier.repeat_interleave(shape.topk))
            slots += [-1] * child_ids.numel()
            best = child_scores.flatten().topk(min(shape.topk, child_ids.numel())).indices
            frontier = base + best
            frontier_hidden = out[:, best // shape.topk]
        return self.draft_ids[torch.cat(node_ids)].cpu(), torch.cat(parents).cpu(), torch.cat(node_scores).cpu()

    def _worth_growing(self, parents: list[int], scores: torch.Tensor, frontier: list[int], total: int) -> bool:
        """Another level of the tree pays for its drafter step only if a child of the best frontier node could:
        its chance of acceptance is at most that node's, which must cover the step and the row it adds to the
        verify forward beyond the nodes already worth verifying."""
        if self.budget.is_fixed:
            return True
        reach = self.budget.tree_reach(parents, node_confidences(parents, scores.tolist()))
        worth = self.budget.best_length(sorted(reach, reverse=True)[:total])
        return worth < total and self.budget.continues(max(reach[i] for i in frontier), worth)

    def _score_last_tree(self, tokens: torch.Tensor) -> None:
        """Calibrate the budget on the last tree, verified or not, against what the target then wrote."""
        if self.last_tree is None:  # none drafted since, or a fixed budget (nothing to calibrate)
            return
        start, drafted, parents, confidences = self.last_tree
        self.budget.record_tree(drafted, parents, confidences, tokens[start:].tolist())
        self.last_tree = None

    def _score_last_chain(self, tokens: torch.Tensor) -> None:
        """Calibrate the budget: how far the last chain, proposed or not, matched what the target then wrote."""
        if self.last_chain is None:
            return
        start, chain, confidences = self.last_chain
        self.budget.record_chain(chain, tokens[start : start + len(chain)].tolist(), confidences)
        self.last_chain = None

    def _pick(
        self, logits: torch.Tensor, temperature: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """Greedy, or a sample from softmax(logits / T): the target id, q over the target vocabulary (None when
        greedy), and the drafter's confidence in the token (its top probability at T=1)."""
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        confidence = float(torch.softmax(wide, dim=-1).max())
        if temperature <= 0:
            return self.draft_ids[logits.argmax()], None, confidence
        q = torch.softmax(wide / temperature, dim=-1)
        choice = torch.multinomial(q.cpu(), 1, generator=generator)[0].to(self.device)
        full = q.new_zeros(self.model.config.vocab_size)
        full[self.draft_ids] = q
        return self.draft_ids[choice], full, confidence

    def step_probe(self, context: int = 128) -> Callable[[], None]:
        """One draft step over a `context`-position cache, as a callable: what the budget times at load."""
        model, cache = self.model, KVCache()
        zeros = torch.zeros(1, context, model.config.hidden_size, device=self.device, dtype=model.fc.weight.dtype)
        with torch.inference_mode():
            model.forward_hidden(zeros, zeros, torch.arange(context, device=self.device), cache)
        position = torch.tensor([context], device=self.device)

        def step() -> None:
            with torch.inference_mode():
                model(zeros[:, :1], zeros[:, :1], position, cache)
            cache.crop(context)

        return step

    @torch.inference_mode()
    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        """Keep the target's features of the confirmed positions; drop the drafted positions from the cache."""
        if features is not None:
            self._append(features)
        self.cache.crop(self.context)


def save_checkpoint(model: Eagle3Model, directory: str | Path) -> Path:
    """model.safetensors (every weight but the frozen embeddings, which come back from the target) + config.json."""
    return save_drafter(model, directory, FROZEN)


def save_drafter(model: nn.Module, directory: str | Path, frozen: tuple[str, ...]) -> Path:
    """A drafter's weights but `frozen` (the target's own) and its pydantic `config`, each written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in frozen}
    tmp = directory / f".{WEIGHTS_FILE}.tmp{os.getpid()}"
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, directory / WEIGHTS_FILE)
    tmp = directory / f".{CONFIG_FILE}.tmp{os.getpid()}"
    tmp.write_text(model.config.model_dump_json(indent=2) + "\n")
    os.replace(tmp, directory / CONFIG_FILE)
    return directory


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a training run directory: the checkpoint its `best` file names (the best
    validation), else its `latest`."""
    path = Path(path)
    for pointer in ("best", "latest"):
        if (path / pointer).is_file():
            return resolve_checkpoint(path / (path / pointer).read_text().strip())
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise DraftsmithError(
            f"{path} is not an EAGLE-3 checkpoint: expected {CONFIG_FILE} and {WEIGHTS_FILE} there",
            hint="pass a training run directory (with a `latest` file) or one of its checkpoints/step-* directories",
        )
    return path


def read_config(path: Path) -> Eagle3Config:
    file = path / CONFIG_FILE
    try:
        return Eagle3Config(**json.loads(file.read_text()))
    except (json.JSONDecodeError, ValidationError, TypeError) as exc:
        raise DraftsmithError(
            f"{file} is not a valid EAGLE-3 config: {str(exc).splitlines()[0]}",
            hint="the checkpoint is damaged or was written by another tool; re-run `draftsmith train`",
        ) from None


def check_compatible(config: Eagle3Config, target: Target, where: str = "checkpoint") -> None:
    """Fail before any long work when a drafter cannot run on `target`."""
    checks = [
        ("hidden size", config.hidden_size, target.hidden_size),
        ("vocabulary size", config.vocab_size, target.vocab_size),
    ]
    for what, mine, theirs in checks:
        if mine != theirs:
            raise DraftsmithError(
                f"{where} {what} {mine} != target {theirs}",
                hint=f"this drafter was trained for {config.target or 'another target'}, not {target.name}",
            )
    if max(config.aux_layer_ids) >= target.num_layers:
        raise DraftsmithError(
            f"{where} reads layers {config.aux_layer_ids} but target {target.name} has {target.num_layers} layers",
            hint=f"this drafter was trained for {config.target or 'another target'}",
        )
