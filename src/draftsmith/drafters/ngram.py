"""Prompt-lookup (n-gram) drafting that proposes only as much as is likely to pay.

The draft is what followed the most recent earlier occurrence of the longest suffix n-gram of the context
(prompt and generated text). Proposing is not free: on a CPU a forward over a few tokens costs more than a forward
over one, and not in proportion: on the AMX Xeon a forward over 2-3 new tokens cost ~1.1x one over a single token
and over 4 ~1.4x (`DraftBudget.forward_costs`, timed at load). So the continuation is cut with the same rule as a
learned drafter's chain (`DraftBudget.best_length`): the prefix with the most expected tokens per unit of forward,
nothing when no prefix beats a plain step. Proposing the whole 4-token continuation whenever its mean gain passed a
fixed break-even, as before, spent the 4-token forward on every lookup.

The expected tokens come from experience: per matched n-gram length, the decayed share of lookups whose
continuation matched the target's text for at least 1, 2, ... tokens. Every lookup, proposed or not, is scored
against the text the target then actually generates (at T=0 a draft gains exactly its longest prefix that matches),
so a length that went silent is still measured and speaks up again when the text turns repetitive. Recent evidence
weighs more (`decay`), because how much a text repeats itself changes from prompt to prompt.
"""

from dataclasses import dataclass

import torch

from draftsmith.decode.tree import TreeShape
from draftsmith.drafters.base import Draft
from draftsmith.drafters.budget import DraftBudget

HORIZON = 16  # draft positions whose outcomes are counted; a continuation is cut there when the budget is not fixed
PRIOR_REACH = 0.5  # before any evidence: each next token matches half the time (a first lookup speaks, briefly)


@dataclass
class _Outcomes:
    """Decayed counts of lookups and, per draft position i, of lookups that matched at least i + 1 tokens; seeded
    with `prior_weight` lookups that match each next token with chance PRIOR_REACH."""

    lookups: float
    reached: list[float]

    @classmethod
    def prior(cls, weight: float) -> "_Outcomes":
        return cls(weight, [weight * PRIOR_REACH ** (i + 1) for i in range(HORIZON)])

    def reaches(self, length: int) -> list[float]:
        """P(the first 1, 2, ..., `length` tokens of a continuation all match)."""
        return [r / self.lookups for r in self.reached[:length]]

    def add(self, gained: int, decay: float) -> None:
        self.lookups = decay * self.lookups + 1
        self.reached = [decay * r + (i < gained) for i, r in enumerate(self.reached)]


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
        budget: DraftBudget | None = None,
        prior_weight: float = 2.0,
        decay: float = 0.95,
        tree: TreeShape | None = None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = f"ngram[{min_ngram}-{max_ngram}]"
        self.tree = tree  # propose up to `topk` continuations of up to `depth` tokens merged into one tree
        self.min_ngram, self.max_ngram, self.decay = min_ngram, max_ngram, decay
        # the forward costs that decide how much to propose; no drafter steps (a lookup is nearly free)
        self.budget = budget or DraftBudget(step_cost=0.0)
        self.outcomes = {n: _Outcomes.prior(prior_weight) for n in range(min_ngram, max_ngram + 1)}
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
        if self.budget.is_fixed:
            keep = len(continuation)
        else:
            keep = self.budget.best_length(self.outcomes[n].reaches(min(len(continuation), HORIZON)))
        if keep == 0:
            return Draft.empty()
        if self.tree is not None:
            return self._tree(tokens, max_tokens)
        return Draft(continuation[:keep])

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
                self.outcomes[lookup.n].add(gained, self.decay)
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
