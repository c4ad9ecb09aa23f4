"""The drafter protocol: the only thing the engine knows about a drafter.

A round of speculative decoding, as the engine drives it:

    begin(prompt, features)          once, after the target's prefill
    propose(tokens, k, T, gen) -> Draft  up to k candidate tokens continuing `tokens` (prompt + generated so far);
                                     a sampling drafter draws from `gen`, the engine's seeded generator, so one
                                     seed fixes the whole output and every draft is a fresh draw from its q
    accepted(n, features)            the target kept the first n draft tokens (and added one of its own);
                                     the drafter rolls its state back to match

A drafter may return a tree instead of a chain (`Draft.parents`): then the features passed to `accepted` are those
of the newest confirmed token and of the accepted path's nodes, in path order, as for a chain.

`features` are the target's hidden states at `aux_layer_ids` (see target.py for the index convention) for the
tokens the target has just confirmed, or None when the drafter asks for no layers. Like transformers'
`CandidateGenerator`, a drafter may return fewer than k tokens, or none, when drafting would not pay.
"""

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Draft:
    tokens: torch.Tensor  # (m,) int64 target-vocabulary ids, m <= k
    probs: torch.Tensor | None = None  # (m, vocab) the distributions q they were sampled from; None = deterministic
    # (m,) a tree: node i's parent index (< i), -1 for children of the newest confirmed token; None = a chain.
    # Siblings are tried in node order (decode/tree.py); `accepted(n, ...)` then counts the accepted path's nodes.
    parents: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> "Draft":
        return cls(torch.empty(0, dtype=torch.long))

    @classmethod
    def from_tree(cls, tokens: torch.Tensor, parents: list[int], keep: list[int]) -> "Draft":
        """The nodes `keep` (ascending, parents kept before their children) of a grown tree with `tokens` and
        `parents`, renumbered; verified without a tree mask when they form a chain."""
        if not keep:
            return cls.empty()
        new_index = {old: new for new, old in enumerate(keep)}
        kept_parents = torch.tensor([new_index.get(parents[i], -1) for i in keep], dtype=torch.long)
        if torch.equal(kept_parents, torch.arange(len(keep)) - 1):
            return cls(tokens[keep])
        return cls(tokens[keep], parents=kept_parents)


class Drafter(Protocol):
    name: str
    aux_layer_ids: tuple[int, ...]

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None: ...

    def propose(
        self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator
    ) -> Draft: ...

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None: ...


class NullDrafter:
    """Proposes nothing: plain decoding through the engine, which isolates the engine's own overhead."""

    name = "none"
    aux_layer_ids: tuple[int, ...] = ()

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator) -> Draft:
        return Draft.empty()

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        pass
