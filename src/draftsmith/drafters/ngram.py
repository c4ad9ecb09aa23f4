"""Prompt-lookup (n-gram) drafting that proposes only when it is likely to pay.

The draft is what followed the most recent earlier occurrence of the longest suffix n-gram of the context
(prompt and generated text). Proposing is not free: on a CPU a forward over 2-8 tokens costs ~1.6x a forward
over one, so a draft pays only if it is expected to gain more than `break_even` (= that cost ratio - 1) accepted
tokens. The drafter learns, per matched n-gram length, how many tokens its drafts actually gain, and stays silent
for match lengths that do not pay on the current workload; on a GPU, where extra tokens are nearly free, set
`break_even` near 0.
"""

from dataclasses import dataclass

import torch

from draftsmith.drafters.base import Draft


@dataclass
class _Yield:
    """Running mean of accepted tokens per proposal, seeded with `prior_weight` proposals at the break-even value."""

    proposals: float
    accepted: float

    @property
    def mean(self) -> float:
        return self.accepted / self.proposals


class NgramDrafter:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(
        self, min_ngram: int = 1, max_ngram: int = 4, break_even: float = 0.6, prior_weight: float = 2.0
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = f"ngram[{min_ngram}-{max_ngram}]"
        self.min_ngram, self.max_ngram, self.break_even = min_ngram, max_ngram, break_even
        # Optimistic start: every match length first gets the benefit of the doubt, then its measured yield.
        self.yields = {n: _Yield(prior_weight, prior_weight * break_even) for n in range(min_ngram, max_ngram + 1)}
        self._pending: int | None = None  # match length of the draft awaiting its verdict

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        self._pending = None

    def propose(
        self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator
    ) -> Draft:
        match = self._longest_match(tokens, max_tokens)
        if match is None:
            return Draft.empty()
        n, continuation = match
        if self.yields[n].mean < self.break_even:
            return Draft.empty()
        self._pending = n
        return Draft(continuation)

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        if self._pending is not None:
            stats = self.yields[self._pending]
            stats.proposals += 1
            stats.accepted += num_accepted
            self._pending = None

    def _longest_match(self, tokens: torch.Tensor, max_tokens: int) -> tuple[int, torch.Tensor] | None:
        """(n, continuation) for the longest suffix n-gram seen before, continuation from its latest occurrence."""
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = tokens[: length - 1].unfold(0, n, 1)  # every n-gram that ends before the last token
            hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return n, tokens[start : start + max_tokens].clone()
        return None
