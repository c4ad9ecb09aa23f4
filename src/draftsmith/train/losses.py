"""The training-time test (TTT): unroll the drafter K steps on its own outputs, as it will run at inference.

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

import torch
import torch.nn.functional as F

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
def target_distribution(last_hidden: torch.Tensor, draft_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the target's final hidden states (N, H) and its head rows of the draft vocabulary (Vd, H): p over the
    draft vocabulary (N, Vd), renormalised, and its sum p log p (N,)."""
    log_p = torch.log_softmax(last_hidden.float() @ draft_head.float().T, dim=-1)
    p = log_p.exp()
    return p, (p * log_p).sum(-1)


@torch.no_grad()
def target_top(last_hidden: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
    """The target's own argmax over its full vocabulary (N,), which top-1 agreement is measured against. Chunked,
    so the full-vocabulary logits of a long sequence never sit in memory at once; the trainer computes it once per
    sample and caches it, because it costs more than the whole draft-vocabulary distribution."""
    head = target_head.float()
    return torch.cat([(chunk @ head.T).argmax(-1) for chunk in last_hidden.float().split(TARGET_CHUNK)])


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
) -> tuple[torch.Tensor, StepStats]:
    """sum_k step_weight^k * KL(p || q_k) summed over valid positions / denominators[k], and per-step sums.

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
    p, neg_entropy = target_distribution(batch["last_hidden"][needed], target_head[draft_ids])
    if "target_top" in batch:
        top = batch["target_top"][needed]
    else:
        top = target_top(batch["last_hidden"][needed], target_head)

    total = p.new_zeros(())
    stats = StepStats.zeros(steps, p.device)
    for k, hidden in enumerate(ttt_forward(model, batch["input_ids"], batch["aux_hidden"], steps)):
        b, t = valid[k].nonzero(as_tuple=True)
        target_row = row[b, t + 1 + k]
        logits = model.draft_logits(hidden[b, t]).float()
        kl = F.cross_entropy(logits, p[target_row], reduction="none") + neg_entropy[target_row]
        total = total + step_weight**k * kl.sum() / denominators[k].clamp_min(1)
        stats.loss_sum[k] += kl.sum().detach()
        guess = logits.argmax(-1)
        stats.correct[k] += (draft_ids[guess] == top[target_row]).sum()  # what greedy verification accepts
        stats.correct_draft[k] += (guess == p[target_row].argmax(-1)).sum()  # speculators' metric
        stats.count[k] += len(b)
    return total, stats
