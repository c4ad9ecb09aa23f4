"""Verification: decide how many draft tokens the target accepts, losslessly.

Greedy: accept while the draft token equals the target's argmax; the next token is the target's argmax after the
accepted prefix. Sampling (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): accept draft token x
with probability min(1, p(x)/q(x)); on the first rejection sample from normalise(max(0, p - q)); if every draft is
accepted, sample a bonus token from p. A drafter without probabilities is a point mass, q(x) = 1.
Either way the output is distributed exactly as the target's own decoding.
"""

import torch


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T), restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep a token while the mass before it is below top_p: the smallest set whose mass reaches top_p.
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    nucleus = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return nucleus / nucleus.sum(-1, keepdim=True)


def verify_greedy(draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """`logits` (k+1, V) from the forward over [last, d1..dk]; returns (accepted count, next token)."""
    choice = logits.argmax(-1)
    accepted = int((draft == choice[: len(draft)]).cumprod(0).sum()) if len(draft) else 0
    return accepted, int(choice[accepted])


def verify_sampling(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """`probs` (k+1, V) target distributions, `draft_probs` (k, V) or None; returns (accepted count, next token)."""
    k = len(draft)
    uniforms = torch.rand(k, generator=generator, device=probs.device)
    for i in range(k):
        x = int(draft[i])
        q = probs.new_zeros(probs.shape[-1])
        if draft_probs is None:
            q[x] = 1.0
        else:
            q = draft_probs[i].to(probs)
        if uniforms[i] * q[x] <= probs[i, x] and q[x] > 0:
            continue
        residual = (probs[i] - q).clamp_min(0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else probs[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(probs[k], 1, generator=generator))
