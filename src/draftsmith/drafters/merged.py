"""Several drafters verified as one tree: a learned drafter and the n-gram drafter guess different things.

The n-gram drafter is right where the text repeats itself (code, lists, quotes of the prompt), a learned drafter
where the target writes what it usually writes; each is weak where the other is strong. Verifying both proposals
in the same target forward costs little more than one (a forward over 8 new tokens ~1.14x one over a single token
on a CPU, `benchmarks/verify_cost.py`), and the accepted path is whichever proposal the target agrees with longer.

Deterministic proposals (greedy chains, EAGLE-2 trees, n-gram lookups) merge into one trie: a shared prefix is
verified once, and siblings keep the order of the drafters. A sampled proposal keeps its own subtree with its
distributions q; the deterministic nodes beside it get point masses, which multi-candidate rejection sampling
handles losslessly (decode/tree.py), so the merge never changes the output distribution.

With `take_turns` (`RUN_DIR|ngram`) the drafters take turns instead: the training-free ones are asked first and
the first that proposes drafts the round alone; the learned drafter drafts only the rounds where they are silent. A
lookup that speaks has matched a repeat and is cheap; the learned drafter's chain costs several of its forwards, so
it is spent where nothing cheaper has a guess. The learned drafter still hears every confirmed token's features.
"""

import torch

from draftsmith.drafters.base import Draft, Drafter
from draftsmith.errors import ConfigError


class MergedDrafter:
    """The drafter protocol over several drafters; at most one of them reads target features."""

    def __init__(self, parts: list[Drafter], take_turns: bool = False) -> None:
        learned = [d for d in parts if d.aux_layer_ids]
        if len(parts) < 2 or len(learned) > 1:
            names = ", ".join(d.name for d in parts)
            raise ConfigError(
                f"cannot merge drafters {names}: need two or more, at most one of them reading target features",
                hint="merge one learned drafter (EAGLE-3 or DFlash) with training-free ones, e.g. RUN_DIR+ngram",
            )
        self.parts = parts
        self.take_turns = take_turns  # one drafter a round, the training-free ones first (see the module docstring)
        self.name = ("|" if take_turns else "+").join(d.name for d in parts)
        self.aux_layer_ids: tuple[int, ...] = learned[0].aux_layer_ids if learned else ()

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        for part in self.parts:
            part.begin(prompt, features if part.aux_layer_ids else None)

    def propose(self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator) -> Draft:
        if not self.take_turns:
            return merge([part.propose(tokens, max_tokens, temperature, generator) for part in self.parts])
        first, *cheap = self.parts
        # every training-free part is asked each round: each scores its earlier lookups against the text so far
        drafts = [part.propose(tokens, max_tokens, temperature, generator) for part in cheap]
        spoken = next((d for d in drafts if len(d.tokens)), None)
        return spoken if spoken is not None else first.propose(tokens, max_tokens, temperature, generator)

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        """Every part hears how many tokens of the accepted path were drafted: a learned part keeps the target's
        features of the confirmed tokens whichever proposal they came from, and crops its own drafted positions."""
        for part in self.parts:
            part.accepted(num_accepted, features if part.aux_layer_ids else None)


def _parents(draft: Draft) -> list[int]:
    return draft.parents.tolist() if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))


def merge(drafts: list[Draft]) -> Draft:
    """One tree holding every draft's root-to-leaf paths; a lone non-empty draft is returned unchanged."""
    drafts = [d for d in drafts if len(d.tokens)]
    if not drafts:
        return Draft.empty()
    if len(drafts) == 1:
        return drafts[0]
    sampled = [d.probs for d in drafts if d.probs is not None]
    ids: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor | None] = []  # each node's q, None for a deterministic pick
    child: dict[tuple[int, int], int] = {}  # (parent, token) -> node, for deterministic nodes only
    for draft in drafts:
        local: list[int] = []  # this draft's node i -> merged node
        for i, (token, parent) in enumerate(zip(draft.tokens.tolist(), _parents(draft), strict=True)):
            at = -1 if parent < 0 else local[parent]
            key = (at, token)
            if draft.probs is None and key in child:
                local.append(child[key])
                continue
            local.append(len(ids))
            if draft.probs is None:
                child[key] = len(ids)
            ids.append(token)
            parents.append(at)
            rows.append(None if draft.probs is None else draft.probs[i])
    probs = None
    if sampled:  # point masses for the deterministic nodes, so every node has its q
        point = torch.zeros(len(ids), sampled[0].shape[-1], dtype=sampled[0].dtype)
        point[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
        probs = torch.stack([point[i] if row is None else row.to(point) for i, row in enumerate(rows)])
    return Draft(torch.tensor(ids, dtype=torch.long), probs, torch.tensor(parents, dtype=torch.long))
