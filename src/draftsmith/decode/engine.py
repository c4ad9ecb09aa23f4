"""The speculative decoding loop: draft -> verify in one target forward -> accept -> roll back. Batch size 1.

The KV cache always holds every token of the sequence except the newest one, which is fed first in the next
forward together with the draft: one forward over [last, d1..dk] yields the target's distribution after each
prefix, so verification needs no other target call. Rejected drafts are cropped off the cache afterwards.
A drafter may propose a tree instead (`Draft.parents`): one forward over [last, nodes] under the tree mask, the
longest accepted root-to-leaf path, and the cache compacted to that path (decode/tree.py, decode/cache.py).
"""

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import Cache

from draftsmith.decode import tree
from draftsmith.decode.cache import compact, rollback
from draftsmith.decode.verify import target_probs, verify_greedy, verify_sampling
from draftsmith.drafters.base import Draft, Drafter
from draftsmith.errors import ConfigError
from draftsmith.target import Target


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, ending with EOS when the target stopped by itself
    target_forwards: int  # prefill included, so plain decoding has exactly one forward per token
    proposed: list[int] = field(default_factory=list)  # [i]: verify rounds whose draft had a token at position i+1
    accepted: list[int] = field(default_factory=list)  # [i]: rounds in which draft token i+1 was accepted
    seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens produced per target forward: accepted drafts + 1, averaged over forwards."""
        return len(self.tokens) / self.target_forwards


class SpeculativeDecoder:
    """Turns any `Drafter` into faster decoding whose output is exactly the target's own."""

    def __init__(self, target: Target, drafter: Drafter, num_draft_tokens: int = 7) -> None:
        if num_draft_tokens < 1:
            raise ConfigError(
                f"--num-draft-tokens must be at least 1, got {num_draft_tokens}",
                hint="use 1-16; 0 would be plain decoding, which the baseline already measures",
            )
        self.target = target
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> Generation:
        steps = self.rounds(prompt_ids, max_new_tokens, temperature, top_p, seed)
        return deque(steps, maxlen=1).pop()  # every step yields the same, growing Generation

    @torch.inference_mode()
    def rounds(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> Iterator[Generation]:
        """`generate`, one step at a time: yields the growing `Generation` after the prefill and after every
        verify round, so a caller can stream tokens, stop early, or interleave sequences between target forwards."""
        start = time.perf_counter()
        target, drafter, k_max = self.target, self.drafter, self.num_draft_tokens
        target.check_fits(len(prompt_ids), max_new_tokens)
        greedy = temperature <= 0.0
        generator = torch.Generator().manual_seed(seed)
        layers = drafter.aux_layer_ids

        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        seq = torch.empty(len(prompt_ids) + max_new_tokens + k_max + 1, dtype=torch.long)
        seq[: len(prompt)] = prompt
        n = len(prompt)
        cache = target.new_cache()
        out = target.forward(prompt, cache, layers, logits_to_keep=1)
        if greedy:
            first = int(out.logits[-1].argmax())
        else:
            first = int(torch.multinomial(target_probs(out.logits[-1], temperature, top_p), 1, generator=generator))
        seq[n] = first
        n += 1
        result = Generation(tokens=[first], target_forwards=1, proposed=[0] * k_max, accepted=[0] * k_max)
        drafter.begin(prompt, out.aux_hidden)
        result.seconds = time.perf_counter() - start
        yield result

        while len(result.tokens) < max_new_tokens and result.tokens[-1] not in target.eos_token_ids:
            k = min(k_max, max_new_tokens - len(result.tokens) - 1)
            draft = drafter.propose(seq[:n], k, temperature, generator) if k > 0 else Draft.empty()
            if draft.parents is None or not len(draft.tokens):  # a chain (or nothing)
                m = len(draft.tokens)
                out = target.forward(torch.cat([seq[n - 1 : n], draft.tokens]), cache, layers)
                if greedy:
                    n_acc, bonus = verify_greedy(draft.tokens, out.logits)
                else:
                    probs = target_probs(out.logits, temperature, top_p)
                    n_acc, bonus = verify_sampling(draft.tokens, draft.probs, probs, generator)
                if n_acc < m:
                    rollback(cache, n + n_acc)
                path = list(range(n_acc))
                features = None if out.aux_hidden is None else out.aux_hidden[: n_acc + 1]
            else:
                m = int(tree.depths(draft.parents).max())
                path, bonus, features = self._verify_tree(draft, seq[n - 1 : n], cache, temperature, top_p, generator)
                n_acc = len(path)
            result.target_forwards += 1
            for i in range(m):
                result.proposed[i] += 1
                result.accepted[i] += i < n_acc
            if k > 0:
                drafter.accepted(n_acc, features)

            new = draft.tokens[path].tolist() + [bonus]
            new = new[: max_new_tokens - len(result.tokens)]
            for j, tok in enumerate(new):  # an accepted EOS ends the answer just as the target would have
                if tok in target.eos_token_ids:
                    new = new[: j + 1]
                    break
            seq[n : n + len(new)] = torch.tensor(new)
            n += len(new)
            result.tokens.extend(new)
            result.seconds = time.perf_counter() - start
            yield result

    def _verify_tree(
        self,
        draft: Draft,
        root: torch.Tensor,
        cache: Cache,
        temperature: float,
        top_p: float,
        generator: torch.Generator,
    ) -> tuple[list[int], int, torch.Tensor | None]:
        """One target forward over [root, tree nodes] under the tree mask; returns the accepted path (node indices),
        the next token, and the target features of [root, path]. The cache keeps the root and the path, in order."""
        past = cache.get_seq_length()
        out = self.target.forward(
            torch.cat([root, draft.tokens]),
            cache,
            self.drafter.aux_layer_ids,
            attention_mask=tree.verify_mask(draft.parents, past, torch.float32),
            position_ids=tree.verify_positions(draft.parents, past),
        )
        if temperature <= 0.0:
            path, bonus = tree.accept_greedy(draft.tokens, draft.parents, out.logits)
        else:
            probs = target_probs(out.logits, temperature, top_p)
            path, bonus = tree.accept_sampling(draft.tokens, draft.parents, draft.probs, probs, generator)
        compact(cache, past + 1, [past + 1 + i for i in path])
        rows = [0] + [i + 1 for i in path]
        return path, bonus, None if out.aux_hidden is None else out.aux_hidden[rows]
