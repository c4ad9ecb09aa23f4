"""Prompt-lookup (n-gram) drafting that proposes only when it is likely to pay.

The draft is what followed the most recent earlier occurrence of the longest suffix n-gram of the context
(prompt and generated text). Proposing is not free: on a CPU a forward over a few tokens costs more than a forward
over one (`DraftBudget.forward_costs`, ~1.15x with packed weights on the EPYC), so a draft pays only if it is
expected to gain more than `break_even` (= that cost ratio - 1) accepted tokens. On a GPU, where extra tokens are
nearly free, set `break_even` near 0.

The drafter learns, per matched n-gram length, how many tokens a draft gains, and stays silent for lengths that
do not pay. It scores every lookup, proposed or not, against the text the target then actually generates (a
draft gains exactly its longest prefix that matches that text at T=0), so a length that went silent is still
measured and speaks up again when the text turns repetitive. Recent evidence weighs more (`decay`), because how
much a text repeats itself changes from prompt to prompt.
"""

from dataclasses import dataclass

import torch

from draftsmith.decode.tree import TreeShape
from draftsmith.drafters.base import Draft
from draftsmith.drafters.budget import DEFAULT_FORWARD_COSTS


@dataclass
class _Yield:
    """Decayed mean of tokens gained per lookup, seeded with `prior_weight` lookups at the break-even value."""

    lookups: float
    gained: float

    @property
    def mean(self) -> float:
        return self.gained / self.lookups

    def add(self, gained: int, decay: float) -> None:
        self.lookups = decay * self.lookups + 1
        self.gained = decay * self.gained + gained


@dataclass
class _Lookup:
    n: int  # matched n-gram length
    start: int  # sequence position where the continuation would go
    tokens: list[int]


class NgramDrafter:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(
        self,
        min_ngram: int = 1,
        max_ngram: int = 4,
        break_even: float = DEFAULT_FORWARD_COSTS[1] - 1,
        prior_weight: float = 2.0,
        decay: float = 0.95,
        tree: TreeShape | None = None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = f"ngram[{min_ngram}-{max_ngram}]"
        self.tree = tree  # propose up to `topk` continuations of up to `depth` tokens merged into one tree
        self.min_ngram, self.max_ngram, self.break_even, self.decay = min_ngram, max_ngram, break_even, decay
        self.yields = {n: _Yield(prior_weight, prior_weight * break_even) for n in range(min_ngram, max_ngram + 1)}
        self._open: list[_Lookup] = []  # lookups whose outcome the generated text has not settled yet

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        self._open = []

    def propose(self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator) -> Draft:
        self._settle(tokens)
        match = self._longest_match(tokens, max_tokens)
        if match is None:
            return Draft.empty()
        n, continuation = match
        self._open.append(_Lookup(n, len(tokens), continuation.tolist()))
        if self.yields[n].mean < self.break_even:
            return Draft.empty()
        if self.tree is not None:
            return self._tree(tokens, max_tokens)
        return Draft(continuation)

    def _tree(self, tokens: torch.Tensor, max_tokens: int) -> Draft:
        """The continuations after the `topk` latest occurrences of the longest matching suffixes (longest match
        first, then shorter ones), merged into a trie: shared prefixes are verified once, and the siblings are tried
        in that order. At most `total` nodes, `depth` deep."""
        shape = self.tree
        depth, total = min(shape.depth, max_tokens), min(shape.total, max_tokens)
        length = len(tokens)
        ids: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        starts: list[int] = []  # where each merged continuation starts; a shorter match there adds nothing new
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = tokens[: length - 1].unfold(0, n, 1)
            for hit in reversed((windows == tokens[length - n :]).all(dim=1).nonzero().flatten().tolist()):
                if len(starts) == shape.topk or len(ids) == total:
                    break
                if hit + n in starts:
                    continue
                starts.append(hit + n)
                at = -1
                for token in tokens[hit + n : hit + n + depth].tolist():
                    if (at, token) not in child:
                        if len(ids) == total:
                            break
                        child[(at, token)] = len(ids)
                        ids.append(token)
                        parents.append(at)
                    at = child[(at, token)]
        return Draft(torch.tensor(ids, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        pass  # outcomes are read from the generated text in `_settle`, for silent lookups too

    def _settle(self, tokens: torch.Tensor) -> None:
        """Score each open lookup once the text shows where it diverged, or shows all of it."""
        still_open = []
        for lookup in self._open:
            known = tokens[lookup.start : lookup.start + len(lookup.tokens)].tolist()
            gained = next((i for i, (a, b) in enumerate(zip(known, lookup.tokens, strict=False)) if a != b), len(known))
            if gained < len(known) or len(known) == len(lookup.tokens):
                self.yields[lookup.n].add(gained, self.decay)
            else:
                still_open.append(lookup)
        self._open = still_open

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
