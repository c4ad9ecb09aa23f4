"""Training objectives: EAGLE-3's training-time test (TTT) and DFlash's block loss (at the end of this file).

The training-time test (TTT): unroll the drafter K steps on its own outputs, as it will run at inference.

For a sequence x with target features f, step 0 at position t reads (embed(x[t+1]), fc(f[t])) and step k >= 1
reads (embed(x[t+1+k]), the step k-1 output hidden at t), at RoPE position t+k. Its output predicts x[t+2+k] and
is trained against the target's distribution at position t+1+k. Step k at t must attend to exactly what the drafter
has cached when it drafts its (k+1)-th token after context position t:

    step-0 keys/values of positions 0..t    (the context, computed from target features)
    step-j keys/values at position t only, for j = 1..k    (the drafter's own earlier draft steps)

`StepCache` builds that: step 0 is plain causal attention; step k adds, to the causal scores against the step-0
keys, one score per earlier step against the key at the query's own position (a diagonal), and softmaxes all of
them together. This costs L*L + L*k scores per step, against L*(k+1)*L for a block mask over K*L keys.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.drafters.dflash import DFlashModel
from draftsmith.drafters.eagle3 import Eagle3Model, band_mask, causal_attention
from draftsmith.train.metrics import StepStats

TARGET_CHUNK = 256  # positions per chunk when computing the target's full-vocabulary logits


class StepCache:
    """The TTT attention pattern over the keys/values of every step run so far (see the module docstring)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per step: (B, kv_heads, L, head_dim)
        self.values: list[torch.Tensor] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """`window`: a sliding-window layer's step-0 keys seen only within t - window < s <= t (speculators')."""
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) == 1:
            return causal_attention(q, k, v, window)
        groups, length = q.shape[1] // k.shape[1], q.shape[2]
        keys = [key.repeat_interleave(groups, dim=1) for key in self.keys]
        values = [value.repeat_interleave(groups, dim=1) for value in self.values]
        scale = q.shape[-1] ** -0.5
        causal = band_mask(length, window, q.device)
        context = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        own = torch.stack([(q * key).sum(-1) for key in keys[1:]], dim=-1) * scale  # (B, heads, L, steps so far)
        scores = torch.cat([context, own], dim=-1)
        weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        out = weights[..., :length] @ values[0]
        return out + (weights[..., length:, None] * torch.stack(values[1:], dim=-2)).sum(-2)


def shift_left(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, t + by] at t along dim 1, zero past the end (those positions never reach the loss)."""
    out = torch.zeros_like(x)
    kept = max(0, x.shape[1] - by)
    out[:, :kept] = x[:, by : by + kept]
    return out


def ttt_forward(
    model: Eagle3Model, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Output hidden states (B, L, H) of each TTT step for `input_ids` (B, L) and target features (B, L, 3H).

    `model.draft_logits` turns them into draft logits; training does so only where a position reaches the loss.
    """
    embeds = model.embed_tokens(input_ids)
    hidden = model.fuse(aux_hidden)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    cache = StepCache()
    hiddens = []
    for k in range(steps):
        hidden = model.forward_hidden(shift_left(embeds, 1 + k), hidden, positions + k, cache)
        hiddens.append(hidden)
    return hiddens


@torch.no_grad()
def target_distribution(
    last_hidden: torch.Tensor, draft_head: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the target's final hidden states (N, H) and its head rows of the draft vocabulary (Vd, H): p over the
    draft vocabulary (N, Vd), renormalised, at `temperature`, and its sum p log p (N,)."""
    log_p = torch.log_softmax(last_hidden.float() @ draft_head.float().T / temperature, dim=-1)
    p = log_p.exp()
    return p, (p * log_p).sum(-1)


@torch.no_grad()
def target_top(last_hidden: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
    """The target's own argmax over its full vocabulary (N,), which top-1 agreement is measured against. Chunked,
    so the full-vocabulary logits of a long sequence never sit in memory at once; the trainer computes it once per
    sample and caches it, because it costs more than the whole draft-vocabulary distribution. It computes in the
    head's dtype (bf16 when training in bf16: 3x faster on CPU; `max`, since `argmax` is 3x slower on bf16)."""
    rows = last_hidden.to(target_head.dtype).split(TARGET_CHUNK)
    return torch.cat([F.linear(chunk, target_head).max(-1).indices for chunk in rows])


def valid_positions(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """(steps, B, L) bool: step k at position t counts when its predicted token x[t+2+k] exists and is masked in."""
    return torch.stack([shift_left(loss_mask.bool(), 2 + k) for k in range(steps)])


def ttt_loss(
    model: Eagle3Model,
    batch: dict[str, torch.Tensor],
    target_head: torch.Tensor,
    steps: int,
    step_weight: float,
    denominators: torch.Tensor,
    forward: Callable[..., list[torch.Tensor]] = ttt_forward,
    label_temperature: float = 1.0,
    reached_only: bool = False,
    feature_weight: float = 0.0,
) -> tuple[torch.Tensor, StepStats]:
    """sum_k step_weight^k * KL(p || q_k) summed over valid positions / denominators[k], and per-step sums.
    `forward`: `ttt_forward` or a compiled copy of it (`TTTObjective.compile`). `label_temperature` < 1 sharpens p
    towards the target's argmax, the only token greedy verification accepts. `reached_only` (GRIFFIN's loss
    masking, Hu et al. 2025): step k's KL counts only at positions where every earlier step drafted the target's
    argmax, the only positions where greedy verification ever runs step k; the denominators stay all valid
    positions, so a step's loss is its expected loss per round. The logged per-step loss and top-1 stay over every
    valid position, comparable with and without it. `feature_weight` > 0 adds EAGLE-1's feature regression to the
    optimised loss: the squared error between the drafter's normed state and the target's final normed state at
    t+1+k, relative to the latter's squared norm. The head reads only the draft vocabulary's directions of that
    state; the regression asks for all of it, the target's whole view of the next token.

    `denominators` (steps,) are the valid-position counts of the whole global batch (all micro-batches and ranks),
    so summing the micro-batch losses gives the exact token-level mean however the batch is split. KL is the soft
    cross entropy plus sum p log p: the same gradient, and 0 when the drafter matches the target.
    """
    mask = batch["loss_mask"].bool()
    valid = valid_positions(mask, steps)
    # The target distribution at j is needed exactly when token j+1 is in the loss mask: compute only those rows.
    needed = shift_left(mask, 1)
    row = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    row[needed] = torch.arange(int(needed.sum()), device=mask.device)
    draft_ids = model.draft_to_target(torch.arange(model.config.draft_vocab_size, device=model.d2t.device))
    p, neg_entropy = target_distribution(batch["last_hidden"][needed], target_head[draft_ids], label_temperature)
    if "target_top" in batch:
        top = batch["target_top"][needed]
    else:
        top = target_top(batch["last_hidden"][needed], target_head)
    draft_top = p.max(-1).indices  # `max`: argmax's first maximum, ~3x faster on a CPU

    total = p.new_zeros(())
    stats = StepStats.zeros(steps, p.device)
    reached = torch.ones_like(mask)  # every earlier step at this position was scored and drafted the target's argmax
    for k, hidden in enumerate(forward(model, batch["input_ids"], batch["aux_hidden"], steps)):
        b, t = valid[k].nonzero(as_tuple=True)
        target_row = row[b, t + 1 + k]
        state = model.draft_state(hidden[b, t])
        logits = model.lm_head(state).float()
        kl = F.cross_entropy(logits, p[target_row], reduction="none") + neg_entropy[target_row]
        scored = kl
        if feature_weight:
            goal = batch["last_hidden"][b, t + 1 + k].float()
            error = (state.float() - goal).square().sum(-1) / goal.square().sum(-1).clamp_min(1e-6)
            scored = kl + feature_weight * error
        if reached_only:
            scored = scored[reached[b, t]]
        total = total + step_weight**k * scored.sum() / denominators[k].clamp_min(1)
        stats.loss_sum[k] += kl.sum().detach()
        guess = logits.detach().max(-1).indices
        right = draft_ids[guess] == top[target_row]  # what greedy verification accepts
        scored_right = torch.zeros_like(mask)
        scored_right[b, t] = right
        reached &= scored_right
        stats.correct[k] += right.sum()
        stats.chain[k] += reached.sum()
        stats.correct_draft[k] += (guess == draft_top[target_row]).sum()  # speculators' metric
        stats.count[k] += len(b)
    return total, stats


# --- DFlash: the block loss ------------------------------------------------------------------------------------------
#
# An anchor a is a position whose token x[a] is inside the loss mask (an assistant token the target wrote): the
# block there is [x[a], mask x (B-1)] at positions a..a+B-1, and block position k >= 1 predicts x[a+k]. The block sees
# the context keys of positions < a and its own block, never another block: exactly what the drafter sees at
# inference when the target has just confirmed x[a] (`DFlashDrafter`, a test proves the two equal). Position k's
# loss is weighted exp(-(k-1)/gamma), i.e. step_weight**(k-1) with step_weight = exp(-1/gamma), so the StepStats
# "step" k-1 is block position k.


def dflash_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to `count` anchors (sorted) for one sequence: positions a >= 1 inside the loss mask with a successor."""
    mask = loss_mask.bool().clone()
    mask[0] = False  # a block needs some context before it
    mask[-1] = False  # and at least one token after its anchor
    candidates = mask.nonzero()[:, 0]
    order = torch.randperm(len(candidates), generator=generator, device="cpu")[:count].to(candidates.device)
    return candidates[order].sort().values


def dflash_block_mask(anchors: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """(m*B, length + m*B) bool: block query of anchor a sees context keys s < a and the keys of its own block."""
    m = len(anchors)
    query_anchor = anchors.repeat_interleave(block_size)[:, None]
    context = torch.arange(length, device=anchors.device)[None, :] < query_anchor
    block_of = torch.arange(m, device=anchors.device).repeat_interleave(block_size)
    own = block_of[:, None] == block_of[None, :]
    return torch.cat([context, own], dim=1)


def dflash_forward(
    model: DFlashModel, input_ids: torch.Tensor, aux_hidden: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Normed block hidden states (m, B, H) of one sequence (`input_ids` (L,), features (L, n*H)) at `anchors`."""
    block_size, length = model.config.block_size, input_ids.shape[0]
    offsets = torch.arange(block_size, device=input_ids.device)
    tokens = torch.full((len(anchors), block_size), model.config.mask_token_id, device=input_ids.device)
    tokens[:, 0] = input_ids[anchors]
    positions = (anchors[:, None] + offsets[None, :]).reshape(-1)
    context = model.context_kv(aux_hidden[None], torch.arange(length, device=input_ids.device))
    mask = dflash_block_mask(anchors, block_size, length)
    hidden = model.block_hidden(tokens.view(1, -1), positions, context, mask)
    return hidden.view(len(anchors), block_size, -1)


def dflash_gamma(block_size: int) -> float:
    """DFlash's decay: 7 for blocks of 16, 4 for blocks of 8 (the paper's settings), scaled for other sizes."""
    return {16: 7.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2))


class DFlashObjective:
    """The block loss, with the trainer's objective interface (as `TTTObjective`)."""

    def __init__(
        self, block_size: int, gamma: float | None, anchors: int, kl: bool, seed: int = 0, draft_loss: bool = False
    ) -> None:
        self.block_size, self.anchors, self.kl, self.seed, self.draft_loss = block_size, anchors, kl, seed, draft_loss
        self.steps = block_size - 1
        self.step_weight = math.exp(-1.0 / (gamma or dflash_gamma(block_size)))

    def prepare(self, batch: dict[str, torch.Tensor], draw: int) -> dict[str, torch.Tensor]:
        """Draw the anchors of every sequence (padded with -1), seeded by (seed, `draw`, the sequence's dataset
        index): the training step's number as `draw`, so a resumed run, or one on any number of processes, draws
        the same blocks; a fixed `draw` for validation, so checkpoints compare on the same blocks."""
        generators = [
            torch.Generator().manual_seed(((self.seed * 1_000_003 + draw) * 1_000_033 + int(i)) % 2**63)
            for i in batch["index"]
        ]
        drawn = [dflash_anchors(mask, self.anchors, g) for mask, g in zip(batch["loss_mask"], generators, strict=True)]
        anchors = torch.full((len(drawn), max(1, max(map(len, drawn)))), -1, dtype=torch.long)
        for i, a in enumerate(drawn):
            anchors[i, : len(a)] = a
        return batch | {"anchors": anchors.to(batch["loss_mask"].device)}

    def scored_tokens(self, model: DFlashModel) -> torch.Tensor | None:
        """The target ids the loss scores: with `draft_loss` and a drafter that keeps a draft vocabulary, its
        `draft_ids` (what draftsmith's engine drafts from; the head rows cost Vd/V as much: on a CPU the full
        49k-row head was over half of a step), else None for the full vocabulary."""
        return getattr(model, "draft_ids", None) if self.draft_loss else None

    @staticmethod
    def draft_index(model: DFlashModel, scored: torch.Tensor) -> torch.Tensor:
        """(V,) target id -> its row in `scored`, -1 outside it."""
        index = torch.full((model.config.vocab_size,), -1, dtype=torch.long, device=scored.device)
        index[scored] = torch.arange(len(scored), device=scored.device)
        return index

    def labels(self, batch: dict[str, torch.Tensor], i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For sequence i: anchors, the (m, B-1) positions a+k the block predicts, and whether each counts."""
        anchors = batch["anchors"][i]
        anchors = anchors[anchors >= 0]
        length = batch["loss_mask"].shape[1]
        where = anchors[:, None] + torch.arange(1, self.block_size, device=anchors.device)[None, :]
        inside = where < length
        valid = inside & batch["loss_mask"][i][where.clamp_max(length - 1)].bool()
        return anchors, where.clamp_max(length - 1), valid

    def valid(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(steps,) positions counted per block position over the micro-batch."""
        total = torch.zeros(self.steps, device=batch["loss_mask"].device)
        for i in range(len(batch["loss_mask"])):
            total += self.labels(batch, i)[2].sum(0)
        return total

    def __call__(
        self, model: DFlashModel, batch: dict[str, torch.Tensor], target_head: torch.Tensor, denominators: torch.Tensor
    ) -> tuple[torch.Tensor, StepStats]:
        """sum_k w^(k-1) * (cross entropy of x[a+k], or with `kl` KL(p || q) to the target's distribution at a+k-1)
        over the counted positions / denominators[k-1]; over the draft vocabulary with `draft_loss`."""
        total = target_head.new_zeros(())
        stats = StepStats.zeros(self.steps, target_head.device)
        weights = self.step_weight ** torch.arange(self.steps, device=target_head.device)
        scored = self.scored_tokens(model)
        head = model.lm_head.weight if scored is None else model.lm_head.weight[scored]
        if torch.is_autocast_enabled(head.device.type):  # cast the frozen rows once, not once per sequence
            head = head.to(torch.get_autocast_dtype(head.device.type))
        kl_head = target_head if scored is None else target_head[scored]
        index = None if scored is None else self.draft_index(model, scored)
        for i in range(len(batch["input_ids"])):
            anchors, where, valid = self.labels(batch, i)
            if not valid.any():
                continue
            hidden = dflash_forward(model, batch["input_ids"][i], batch["aux_hidden"][i], anchors)
            rows, cols = valid.nonzero(as_tuple=True)
            logits = F.linear(hidden[rows, cols + 1], head).float()
            at = where[rows, cols]
            if self.kl:
                p, neg_entropy = target_distribution(batch["last_hidden"][i][at - 1], kl_head)
                loss = F.cross_entropy(logits, p, reduction="none") + neg_entropy
            elif index is None:
                loss = F.cross_entropy(logits, batch["input_ids"][i][at], reduction="none")
            else:  # a token outside the draft vocabulary cannot be drafted: no loss, counted as a miss
                label = index[batch["input_ids"][i][at]]
                loss = F.cross_entropy(logits, label.clamp_min(0), reduction="none") * (label >= 0)
            total = total + (weights[cols] * loss / denominators[cols].clamp_min(1)).sum()
            guess = logits.argmax(-1).detach()
            guess = guess if scored is None else scored[guess]
            stats.loss_sum.index_add_(0, cols, loss.detach().double())
            stats.correct.index_add_(0, cols, (guess == batch["target_top"][i][at - 1]).double())
            stats.correct_draft.index_add_(0, cols, (guess == batch["input_ids"][i][at]).double())
            stats.count.index_add_(0, cols, torch.ones_like(loss, dtype=torch.float64))
            right = torch.zeros_like(valid)
            right[rows, cols] = guess == batch["target_top"][i][at - 1]
            stats.chain.add_(right.long().cumprod(1).sum(0))  # blocks whose positions 1..k were all right
        return total, stats


class TTTObjective:
    """EAGLE-3's training-time test behind the trainer's objective interface."""

    def __init__(
        self,
        steps: int,
        step_weight: float,
        label_temperature: float = 1.0,
        reached_only: bool = False,
        feature_weight: float = 0.0,
    ) -> None:
        self.steps, self.step_weight, self.label_temperature = steps, step_weight, label_temperature
        self.reached_only, self.feature_weight = reached_only, feature_weight
        self.forward: Callable[..., list[torch.Tensor]] = ttt_forward

    def compile(self) -> None:
        """Run the drafter's unrolled forward through `torch.compile` (dynamic shapes: one graph for every batch
        and sequence length; a second one for validation's no-grad forward). Inductor fuses the layer's small
        element-wise ops, which eager runs one by one: on a 2-core CPU a cpu-full step went from ~2.4 to ~1.8 s
        (bf16 autocast, 16 x ~250 tokens, TTT 4), after ~15 s of compiling in the first step. The loss around it
        gains nothing (its gathers of valid positions break the graph), so it stays eager. A compiler that fails
        (no C++ compiler on a CPU, say) leaves the eager forward, with a warning, on its first call."""
        compiled = torch.compile(ttt_forward, dynamic=True)

        def forward(*args: Any) -> list[torch.Tensor]:
            try:
                return compiled(*args)
            except Exception as error:  # noqa: BLE001 - a compiler failure; an error of the model fails eagerly too
                warnings.warn(f"draftsmith: torch.compile failed ({error}); training eagerly", stacklevel=2)
                self.forward = ttt_forward
                return ttt_forward(*args)

        self.forward = forward

    def prepare(self, batch: dict[str, torch.Tensor], draw: int) -> dict[str, torch.Tensor]:
        return batch

    def valid(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return valid_positions(batch["loss_mask"], self.steps).sum((1, 2))

    def __call__(
        self, model: Eagle3Model, batch: dict[str, torch.Tensor], target_head: torch.Tensor, denominators: torch.Tensor
    ) -> tuple[torch.Tensor, StepStats]:
        return ttt_loss(
            model,
            batch,
            target_head,
            self.steps,
            self.step_weight,
            denominators,
            self.forward,
            self.label_temperature,
            self.reached_only,
            self.feature_weight,
        )
