"""DFlash (z-lab, 2025): a block drafter that writes B-1 tokens in one forward, conditioned on the target's states.

The model, laid out as z-lab's `DFlashDraftModel` lays it out (parameter names map 1:1 onto theirs):

    fc, hidden_norm   Linear(L*H -> H) + RMSNorm: fuse the target's states at L layers into one context vector per
                      position (the *context*)
    layers.i          Qwen3 decoder layers (per-head q/k RMSNorm). Their queries are the block's positions only; their
                      keys/values are [context ; block]: every layer projects the same context with its own k/v
                      projections (no norm, no MLP: the context is injected, not processed), and the block attends
                      to all the context before it and to the whole block, non-causally
    norm              final RMSNorm; the *target's* frozen lm_head turns it into logits over the target vocabulary

A round: the block is [last verified token, mask x (B-1)] at positions p..p+B-1, embedded with the target's frozen
embeddings; block position j >= 1 predicts the token at p+j. The context keys/values of every confirmed position
are cached and grow with the accepted tokens; the block's own keys/values are never kept, so a rejection needs no
rollback. Training (train/losses.py, `dflash_forward`) runs many blocks at once with a mask that shows each block
the context strictly before its anchor and its own block only; a test proves it equals this drafter's rounds.

Layer ids are draftsmith's (the residual stream *entering* layer i, see target.py); z-lab's id i is the *output*
of layer i, ours i + 1. formats/zlab.py converts at the boundary.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from draftsmith.decode.tree import TreeShape
from draftsmith.drafters.base import Draft
from draftsmith.drafters.budget import DraftBudget
from draftsmith.drafters.eagle3 import CONFIG_FILE, MLP, RMSNorm, layer_shape, rope_tables, rotate, save_drafter
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.packed import PackedLinear, can_pack, pack_linears
from draftsmith.target import Target

FROZEN = ("embed_tokens.weight", "lm_head.weight")  # the target's own: restored from the target, never saved
ENGINE_ONLY = ("draft_ids",)  # draftsmith's own engine's draft vocabulary: saved, never exported (engines use the head)
ALGORITHM = "dflash"


class DFlashConfig(BaseModel):
    """Everything needed to rebuild the drafter, and which target it belongs to (saved as config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: str = Field(default=ALGORITHM, pattern=f"^{ALGORITHM}$")
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's: the drafter decodes with the target's head
    num_layers: int = Field(ge=1)  # the drafter's decoder layers
    target_num_layers: int = Field(ge=1)
    aux_layer_ids: tuple[int, ...]  # draftsmith numbering: hidden_states[i], entering layer i
    block_size: int = Field(ge=2)
    mask_token_id: int = Field(ge=0)
    # With a draft vocabulary, draftsmith's engine scores only these target tokens (`draft_ids`, e.g. the EAGLE-3
    # vocab stage's): the head costs Vd/V as much, and any q is lossless. Training and exports keep the full head.
    draft_vocab_size: int | None = Field(default=None, ge=1)
    target: str = ""
    target_fingerprint: str = ""

    @property
    def draft_tokens(self) -> int:
        """Tokens a block proposes: every position but the first, which holds the last verified token."""
        return self.block_size - 1

    @classmethod
    def from_target(
        cls,
        target: Target,
        num_layers: int = 1,
        aux_layer_ids: tuple[int, ...] | None = None,
        block_size: int = 16,
        mask_token_id: int | None = None,
        fingerprint: str | None = None,
        draft_vocab_size: int | None = None,
    ) -> DFlashConfig:
        """Shape the drafter's layers like the target's; default layer ids as z-lab picks them (one per draft
        layer, spread over the target), default mask token from `default_mask_token`."""
        ids = default_layer_ids(target.num_layers, num_layers) if aux_layer_ids is None else tuple(aux_layer_ids)
        mask = default_mask_token(target) if mask_token_id is None else mask_token_id
        config = cls(
            **layer_shape(target, "DFlash"),
            num_layers=num_layers,
            target_num_layers=target.num_layers,
            aux_layer_ids=ids,
            block_size=check_block_size(block_size),
            mask_token_id=mask,
            draft_vocab_size=draft_vocab_size,
            target=target.name,
            target_fingerprint=target.fingerprint() if fingerprint is None else fingerprint,
        )
        check_compatible(config, target, where="DFlash config")
        return config


def check_block_size(block_size: int) -> int:
    if block_size < 2:
        raise ConfigError(
            f"DFlash block size must be at least 2 (the verified token + one mask), got {block_size}",
            hint="use 8 or 16, the sizes published DFlash drafters are trained with",
        )
    return block_size


def default_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """z-lab's default target layers, in draftsmith numbering: one layer at mid-depth for a single id, else `count`
    ids spread evenly over the outputs of layers 1..N-3 (z-lab's numbering), i.e. the inputs of layers 2..N-2."""
    if count == 1:
        return (num_target_layers // 2 + 1,)
    first, last = 1, num_target_layers - 3
    return tuple(round(first + i * (last - first) / (count - 1)) + 1 for i in range(count))


def default_mask_token(target: Target) -> int:
    """A token the target never writes, so its (frozen) embedding means "unknown here": the tokenizer's mask token
    when it has one, else its highest-numbered special token that is not BOS/EOS/PAD, else the last vocabulary id."""
    tok = target.tokenizer
    if getattr(tok, "mask_token_id", None) is not None and tok.mask_token_id < target.vocab_size:
        return int(tok.mask_token_id)
    busy = set(target.eos_token_ids) | {tok.bos_token_id, tok.pad_token_id, tok.eos_token_id}
    spare = [i for i in tok.all_special_ids if i not in busy and i < target.vocab_size]
    return max(spare) if spare else target.vocab_size - 1


def check_compatible(config: DFlashConfig, target: Target, where: str = "checkpoint") -> None:
    """Fail before any long work when a DFlash drafter cannot run on `target` (one line each, with a hint)."""
    made_for = config.target or "another target"
    for what, mine, theirs in (
        ("hidden size", config.hidden_size, target.hidden_size),
        ("vocabulary size", config.vocab_size, target.vocab_size),
    ):
        if mine != theirs:
            raise DraftsmithError(
                f"{where} {what} {mine} != target {theirs}", hint=f"this drafter was made for {made_for}"
            )
    bad = [i for i in config.aux_layer_ids if not 0 <= i < target.num_layers]
    if bad or not config.aux_layer_ids:
        raise DraftsmithError(
            f"{where} reads target layers {list(config.aux_layer_ids)} (draftsmith numbering; z-lab's is one less) "
            f"but target {target.name} has {target.num_layers} layers: ids must be in 0..{target.num_layers - 1}",
            hint=f"this drafter was made for {made_for}, or its layer ids are in the wrong numbering",
        )
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise DraftsmithError(
            f"{where} mask token {config.mask_token_id} is outside the target's vocabulary 0..{target.vocab_size - 1}",
            hint=f"this drafter was made for {made_for}, or its mask_token_id is wrong",
        )
    check_block_size(config.block_size)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values also cover the injected context."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, T, H) -> keys with RoPE, values: (1, kv_heads, T, head_dim) each."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2), cos, sin)
        k, v = self.key_values(x, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # gate/up/down: only hidden_size and intermediate_size are read

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.fc = nn.Linear(len(config.aux_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size))

    def attach(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> DFlashModel:
        """Use the target's embeddings and head (shared, not copied: they stay frozen)."""
        self.embed_tokens.weight = nn.Parameter(embed_weight.detach(), requires_grad=False)
        self.lm_head.weight = nn.Parameter(head_weight.detach(), requires_grad=False)
        return self

    def attach_target(self, target: Target) -> DFlashModel:
        return self.attach(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta, like)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(1, T, L*H) target features at `positions` (T,) -> every layer's context keys/values."""
        fused = self.hidden_norm(self.fc(features))
        cos, sin = self.rope(positions, fused)
        return [layer.self_attn.key_values(fused, cos, sin) for layer in self.layers]

    def block_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block token ids (1, T) at `positions` (T,) over `context` -> normed hidden (1, T, H). Without `mask`
        every block position sees the whole context and the whole block (one block at inference); training packs
        many blocks into T and passes the (T, context + T) mask that keeps them apart."""
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions, x)
        for layer, kv in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)


class DFlashDrafter:
    """The drafter protocol over a `DFlashModel`: one block forward per round, context keys/values cached.

    With a draft vocabulary (`draft_ids`), drafts are scored over those target tokens only, by the matching rows of
    the target's head (`head`). With a measured `budget` (drafters/budget.py) the block is cut to the prefix with
    the most expected tokens per verify forward, from each position's confidence: on a CPU a forward over 8 tokens
    costs more than one over 2, and the block's late positions are rarely right."""

    def __init__(
        self,
        model: DFlashModel,
        name: str = ALGORITHM,
        budget: DraftBudget | None = None,
        tree: TreeShape | None = None,
    ) -> None:
        self.name = name
        self.budget = budget or DraftBudget.fixed()
        self.tree = tree  # draft trees of this shape over each block (`block_tree`); None: the block as a chain
        self.model = model.eval()
        self.draft_ids: torch.Tensor | None = getattr(model, "draft_ids", None)
        self.head = model.lm_head
        if self.draft_ids is not None:
            rows = nn.Linear(model.config.hidden_size, len(self.draft_ids), bias=False)
            rows.weight = nn.Parameter(model.lm_head.weight.detach()[self.draft_ids], requires_grad=False)
            self.head = PackedLinear(rows) if can_pack(rows) else rows
        pack_linears(model)  # a block is B rows: packed weights make it cost about one row
        self.aux_layer_ids: tuple[int, ...] = tuple(model.config.aux_layer_ids)
        self.begin(torch.empty(0, dtype=torch.long), None)

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, context positions only
        self.context = 0
        self.last_chain: tuple[int, list[int], list[float]] | None = None  # (start, tokens, confidences)
        self.last_tree: tuple[int, list[int], list[int], list[float]] | None = None  # (start, tokens, parents, conf.)
        self.pending: list[torch.Tensor] = [] if features is None else [features]

    def _extend_context(self) -> None:
        """Project the target features the engine handed over since the last round into every layer's cache."""
        if not self.pending:
            return
        features = torch.cat(self.pending).to(self.device, self.model.fc.weight.dtype)[None]
        self.pending = []
        positions = torch.arange(self.context, self.context + features.shape[1], device=self.device)
        new = self.model.context_kv(features, positions)
        if self.kv is not None:
            pairs = zip(self.kv, new, strict=True)
            new = [(torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in pairs]
        self.kv, self.context = new, self.context + features.shape[1]

    @torch.inference_mode()
    def block_logits(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        """Logits (count, V) over the full vocabulary for the `count` tokens after `tokens` (one block forward)."""
        return self.model.lm_head(self._block(tokens, count)).float()

    @torch.inference_mode()
    def _block(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        """The normed hidden states (count, H) of the block's first `count` mask positions."""
        self._extend_context()
        if self.context != len(tokens) - 1:
            raise RuntimeError(f"DFlash context covers {self.context} positions, expected {len(tokens) - 1}")
        block = torch.full((1, self.block_size), self.model.config.mask_token_id, device=self.device)
        block[0, 0] = tokens[-1]
        positions = torch.arange(self.context, self.context + self.block_size, device=self.device)
        return self.model.block_hidden(block, positions, self.kv)[0, 1 : 1 + count]

    def propose(self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator) -> Draft:
        count = min(max_tokens, self.block_size - 1)
        if count < 1 or self.budget.resting():
            return Draft.empty()
        if self.last_chain is not None:  # calibrate the budget on what the target wrote after the last block
            start, chain, confidences = self.last_chain
            self.budget.record_chain(chain, tokens[start : start + len(chain)].tolist(), confidences)
            self.last_chain = None
        if self.tree is not None:
            return self._tree_draft(tokens, max_tokens)
        with torch.inference_mode():
            logits = self.head(self._block(tokens, count)).float().cpu()
        ids = None if self.draft_ids is None else self.draft_ids.cpu()
        confidences = torch.softmax(logits, dim=-1).amax(-1).tolist()  # each position's top probability at T=1
        if temperature <= 0:
            choice, q = logits.argmax(-1), None
        else:
            # Every block position is drawn from its own q: the positions are independent given the context, and
            # each q is what the verifier needs for the token at that position.
            q = torch.softmax(logits / temperature, dim=-1)
            choice = torch.multinomial(q, 1, generator=generator)[:, 0]
        drafted = choice if ids is None else ids[choice]
        if q is not None and ids is not None:
            full = q.new_zeros(len(q), self.model.config.vocab_size)
            full[:, ids] = q
            q = full
        reach = [1.0]
        for confidence in confidences:
            reach.append(self.budget.reach(reach[-1], confidence))
        keep = self.budget.best_length(reach[1:])
        self.budget.settle(keep > 0 and self.budget.pays(sum(reach[1 : keep + 1]), keep, steps=1))
        self.last_chain = (len(tokens), drafted.tolist(), confidences)
        if keep == 0:
            return Draft.empty()
        return Draft(drafted[:keep], None if q is None else q[:keep])

    def _tree_draft(self, tokens: torch.Tensor, max_tokens: int) -> Draft:
        """A tree over one block forward (`block_tree`); the budget verifies the part it chooses, a fixed one the
        best `total` nodes. Its nodes are deterministic picks, which sampling verification handles (decode/tree.py)."""
        if self.last_tree is not None:
            start, drafted, parents, confidences = self.last_tree
            self.budget.record_tree(drafted, parents, confidences, tokens[start:].tolist())
            self.last_tree = None
        depth = min(self.tree.depth, max_tokens, self.block_size - 1)
        with torch.inference_mode():
            logits = self.head(self._block(tokens, depth)).float().cpu()
        ids, parents, scores = block_tree(torch.log_softmax(logits, dim=-1), self.tree.topk)
        if self.draft_ids is not None:
            ids = self.draft_ids.cpu()[ids]
        keep, confidences = self.budget.choose_tree(parents, scores, min(self.tree.total, max_tokens), steps=1)
        if not self.budget.is_fixed:
            self.last_tree = (len(tokens), ids.tolist(), parents, confidences)  # scored on the next call
        return Draft.from_tree(ids, parents, keep)

    def step_probe(self, context: int = 128) -> Callable[[], None]:
        """One block forward (and its head) over a `context`-position cache, as a callable: what the budget times
        at load as the drafter's cost per round."""
        model, weight = self.model, self.model.fc.weight
        features = torch.zeros(1, context, weight.shape[1], device=self.device, dtype=weight.dtype)
        with torch.inference_mode():
            kv = model.context_kv(features, torch.arange(context, device=self.device))
        block = torch.full((1, self.block_size), model.config.mask_token_id, device=self.device)
        positions = torch.arange(context, context + self.block_size, device=self.device)

        def step() -> None:
            with torch.inference_mode():
                self.head(model.block_hidden(block, positions, kv)[0, 1:])

        return step

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        """The confirmed positions' features join the context next round; the block left no state to roll back."""
        if features is not None:
            self.pending.append(features)


def block_tree(logp: torch.Tensor, topk: int) -> tuple[torch.Tensor, list[int], list[float]]:
    """EAGLE-2's tree shape over a block's log-probabilities `logp` (depth, V): position 1's top-k are the root's
    children; at each further position the top-k nodes of the level above by cumulative log-probability (the
    frontier) each get that position's top-k tokens as children. A block drafts every position at once from the
    context alone, so a node's children do not depend on its path (Medusa's trees; no drafter step per level).
    Returns (vocabulary ids, parents, cumulative log-probabilities) in topological order, siblings best first."""
    k = min(topk, logp.shape[-1])
    top_scores, top_ids = logp.topk(k, dim=-1)
    scores, ids, parents = [top_scores[0]], [top_ids[0]], [torch.full((k,), -1)]
    frontier, count = torch.arange(k), k
    for level in range(1, len(logp)):
        children = (torch.cat(scores)[frontier, None] + top_scores[level][None]).flatten()
        scores.append(children)
        ids.append(top_ids[level].repeat(len(frontier)))
        parents.append(frontier.repeat_interleave(k))
        frontier = count + children.topk(min(k, len(children))).indices
        count += len(children)
    return torch.cat(ids), torch.cat(parents).tolist(), torch.cat(scores).tolist()


def build_model(config: DFlashConfig, state: dict[str, torch.Tensor], target: Target) -> DFlashModel:
    """A `DFlashModel` with `state` (our names, no frozen weights) on the target's embeddings, head, device, dtype."""
    param = next(target.model.parameters())
    model = DFlashModel(config)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise DraftsmithError(
            f"DFlash weights do not fit their config: {str(exc).splitlines()[0]}",
            hint="the checkpoint is damaged; `draftsmith doctor DIR` shows what is wrong",
        ) from None
    missing = [k for k in missing if k not in FROZEN]
    if missing or unexpected:
        raise DraftsmithError(
            f"DFlash weights missing {missing[:3]} / unexpected {unexpected[:3]}",
            hint="the checkpoint is damaged or is not a DFlash drafter",
        )
    return model.to(param.device, param.dtype).attach_target(target)


def save_checkpoint(model: DFlashModel, directory: str | Path) -> Path:
    """model.safetensors (every weight but the target's embeddings and head) + config.json, written atomically."""
    return save_drafter(model, directory, FROZEN)


def is_config(raw: dict) -> bool:
    return raw.get("algorithm") == ALGORITHM


def read_config(path: Path) -> DFlashConfig:
    file = path / CONFIG_FILE
    try:
        return DFlashConfig(**json.loads(file.read_text()))
    except (json.JSONDecodeError, ValidationError, TypeError) as exc:
        raise DraftsmithError(
            f"{file} is not a valid DFlash config: {str(exc).splitlines()[0]}",
            hint="the checkpoint is damaged or was written by another tool; re-run `draftsmith train --algo dflash`",
        ) from None
