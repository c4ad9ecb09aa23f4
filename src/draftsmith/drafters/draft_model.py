"""The classic small-draft-model method: a causal LM with the target's tokenizer drafts token by token.

The draft model keeps its own KV cache. After verification it is cropped back to the tokens the target kept,
so the next proposal only feeds what the draft model has not seen yet (the target's bonus token and any
accepted draft token it never ran on).
"""

import torch

from draftsmith.decode.cache import rollback
from draftsmith.decode.verify import target_probs
from draftsmith.drafters.base import Draft
from draftsmith.errors import ConfigError
from draftsmith.target import Target


class ModelDrafter:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, draft: Target, target: Target) -> None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ConfigError(
                f"draft model {draft.name!r} does not share the tokenizer of target {target.name!r}",
                hint="a draft model must use exactly the target's vocabulary; pick one from the same model family",
            )
        self.name = f"model:{draft.name}"
        self.draft = draft
        self.vocab_size = target.vocab_size
        self.cache = draft.new_cache()
        self._base = 0  # sequence length when the pending draft was proposed
        self._drafted = 0

    def begin(self, prompt: torch.Tensor, features: torch.Tensor | None) -> None:
        self.cache = self.draft.new_cache()

    def propose(self, tokens: torch.Tensor, max_tokens: int, temperature: float, generator: torch.Generator) -> Draft:
        feed = tokens[self.cache.get_seq_length() :]
        drafted, dists = [], []
        for i in range(max_tokens):
            logits = self.draft.forward(feed, self.cache, logits_to_keep=1).logits[-1, : self.vocab_size]
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                q = target_probs(logits, temperature)
                token = int(torch.multinomial(q, 1, generator=generator))
                dists.append(q)
            drafted.append(token)
            if i + 1 < max_tokens:
                feed = torch.tensor([token])
        self._base, self._drafted = len(tokens), len(drafted)
        return Draft(torch.tensor(drafted, dtype=torch.long), torch.stack(dists) if dists else None)

    def accepted(self, num_accepted: int, features: torch.Tensor | None) -> None:
        # The cache ran on every draft token but the last; keep those the target accepted. A round another drafter
        # drafted (a merge taking turns) left the cache on confirmed tokens only: nothing to undo.
        if self._drafted:
            rollback(self.cache, self._base + min(num_accepted, self._drafted - 1))
        self._drafted = 0
