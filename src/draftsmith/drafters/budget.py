"""How long a draft chain should be: stop where the next token no longer pays for itself.

Cost model of one speculative round, in units of one plain decode step (a target forward over one token):

    forward_costs    a target forward over n new tokens, n = 1, 2, ... (the last token + n - 1 drafts), as a table
    step_cost        the drafter's own step that makes a token (~0.065 on a CPU, for SmolLM2's EAGLE-3 drafter)

A table, not a line: on a CPU the cost of a forward is a step function of the row count, set by which matmul
kernel runs (packed.py). On the AMX Xeon a 2- or 3-token forward cost 1.06-1.10 of a one-token one and a 4-token
forward 1.42 (`benchmarks/verify_cost.py`, one quiet run; the 1-row cost moves between runs); a line fitted
through such points overprices chains of 1-2 and underprices the step to 3. The costs belong to the machine that
decodes: `measure_costs` times them there at load (a few seconds) instead of trusting constants measured
elsewhere; on a GPU they come out near (1, 1, 1, ...) and ~0, i.e. the fixed full chain.

A chain whose i-th token is accepted with probability P_i (the product of the drafter's per-step confidences)
yields 1 + sum(P_i) tokens. Drafting continues while the next token's P_i exceeds its own marginal cost (its
drafter step plus what it adds to the forward), and of the chain drafted the prefix with the most expected tokens
per unit of forward is verified (the drafter's steps are spent by then; no prefix beats a plain step: draft
nothing). A chain *pays* only if it also covers those steps. After a chain that does not pay, the drafter rests for
a growing number of rounds (its context positions are run later, in one batch), so on text it cannot predict it
costs almost nothing.

Calibration. The drafter's softmax confidence c is only roughly calibrated (worse on unfamiliar text), so the
model is P(token accepted | the chain reached it) = min(1, scale * c). `record` gets, for every drafted token whose
fate the target has decided — the tokens up to and including the first mismatch — its *raw* confidence and whether
it matched; scale = (decayed) matches / (decayed) raw confidences, a ratio estimator that converges to the true
ratio (tests/test_budget.py). Recording already-scaled values instead makes the scale settle near the square root
of the truth.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftsmith.decode.tree import children


def linear_costs(verify_cost: float, token_cost: float, length: int = 9) -> tuple[float, ...]:
    """A forward-cost table from a one-draft verify cost and a cost per further token (1, verify, verify + token,
    ...): the shape of the packed-kernel hosts' measurements, used before a machine is measured."""
    return (1.0, *(verify_cost + (n - 2) * token_cost for n in range(2, length + 1)))


DEFAULT_FORWARD_COSTS = linear_costs(1.15, 0.05)  # packed weights, SmolLM2, an AVX512 EPYC (verify_cost.py)


@dataclass
class DraftBudget:
    forward_costs: tuple[float, ...] = DEFAULT_FORWARD_COSTS  # forward over n new tokens: forward_costs[n - 1]
    step_cost: float = 0.065
    decay: float = 0.995  # weight of older tokens in the calibration: a memory of ~200 decided tokens
    confidence: float = 4.0  # decayed sums of raw confidences and of matches: a prior of a few tokens at 1:1
    matched: float = 4.0
    max_rest: int = 16  # most rounds to stay silent after drafts that did not pay
    backoff: int = 0
    resting_for: int = 0

    @classmethod
    def fixed(cls) -> DraftBudget:
        """Always draft the full length (tests, GPU engines, the fixed-chain quality measurement)."""
        return cls(forward_costs=(0.0,), step_cost=0.0)

    @property
    def is_fixed(self) -> bool:
        return self.step_cost == 0.0 and not any(self.forward_costs)

    def forward_cost(self, new_tokens: int) -> float:
        """A forward over `new_tokens`; past the table, its last step repeated per token."""
        table = self.forward_costs
        if new_tokens <= len(table):
            return table[new_tokens - 1]
        slope = table[-1] - table[-2] if len(table) > 1 else 0.0
        return table[-1] + max(0.0, slope) * (new_tokens - len(table))

    @property
    def scale(self) -> float:
        return self.matched / self.confidence if self.confidence > 0 else 1.0

    def reach(self, previous: float, confidence: float) -> float:
        """Calibrated chance that the chain is accepted up to and including a token drafted with `confidence`,
        given the chance `previous` that it got that far."""
        return previous * min(1.0, confidence * self.scale)

    def continues(self, reach: float, length: int) -> bool:
        """Is a token worth drafting after `length` others, given the chance `reach` that it is reached and
        accepted? It must beat its drafter step and what it adds to the verify forward."""
        added = self.forward_cost(length + 2) - self.forward_cost(length + 1)
        return reach >= self.step_cost + max(0.0, added)

    def pays(self, expected: float, length: int, steps: int | None = None) -> bool:
        """Does a chain of `length` tokens with `expected` accepted ones beat one plain decode step? It costs the
        forward over the last token and the chain, and the drafter's steps: one per token for a chain drafter, one
        for a block drafter (DFlash) whatever the length."""
        steps = length if steps is None else steps
        return 1.0 + expected >= self.forward_cost(length + 1) + steps * self.step_cost

    def best_length(self, reaches: list[float]) -> int:
        """How many of a drafted chain's tokens to verify: the prefix with the most expected tokens per unit of
        forward (0: a plain step does better). The drafter's steps are spent either way, so they do not count."""
        if self.is_fixed:
            return len(reaches)
        best, best_rate, expected = 0, 1.0, 1.0
        for length, reach in enumerate(reaches, start=1):
            expected += reach
            rate = expected / max(self.forward_cost(length + 1), 1e-9)
            if rate > best_rate:
                best, best_rate = length, rate
        return best

    def resting(self) -> bool:
        """Skip this round entirely (no drafter forward at all)? After a chain that did not pay the drafter rests
        1, 2, 4, ... rounds, then probes again, so a drafter that is useless on some text costs almost nothing."""
        if self.resting_for > 0:
            self.resting_for -= 1
            return True
        return False

    def settle(self, paid: bool) -> None:
        self.backoff = 0 if paid else min(max(1, 2 * self.backoff), self.max_rest)
        self.resting_for = self.backoff

    def record_chain(self, chain: list[int], written: list[int], confidences: list[float]) -> None:
        """Score a drafted chain, proposed or not, against the tokens the target then wrote after the same point
        (as many as there are yet): its decided tokens are those up to and including the first mismatch."""
        matched = next((i for i, (a, b) in enumerate(zip(chain, written, strict=False)) if a != b), len(written))
        decided = min(matched + 1, len(written), len(chain))
        self.record(confidences[:decided], [i < matched for i in range(decided)])

    def record(self, confidences: list[float], matches: list[bool]) -> None:
        """The raw confidences of a chain's decided tokens (up to and including its first mismatch) and whether
        each matched what the target wrote, whether the chain was proposed or not."""
        for c, hit in zip(confidences, matches, strict=True):
            self.confidence = self.decay * self.confidence + c
            self.matched = self.decay * self.matched + hit

    def tree_reach(self, parents: list[int], confidences: list[float]) -> list[float]:
        """Each tree node's calibrated chance of being accepted: its parent's, times its own calibrated confidence
        (siblings exclude each other, so a tree's expected accepted tokens is the sum over its nodes)."""
        reach: list[float] = []
        for parent, confidence in zip(parents, confidences, strict=True):
            reach.append(self.reach(reach[parent] if parent >= 0 else 1.0, confidence))
        return reach

    def choose_tree(
        self, parents: list[int], scores: list[float], total: int, steps: int
    ) -> tuple[list[int], list[float]]:
        """Which of a grown tree's nodes to verify (ascending: parents before children) and every node's own
        confidence (to score the tree later, `record_tree`). Fixed: the best `total` by cumulative draft
        log-probability `scores`. Adaptive: by calibrated chance of acceptance, as many of the best as give the most
        expected tokens per unit of forward (none when a plain step does better), so a confident round verifies a
        short chain on the cheap row counts and an unsure one pays for siblings only where they pay; the drafter's
        `steps` were spent on growing it."""
        confidences = node_confidences(parents, scores)
        if self.is_fixed:
            return sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:total]), confidences
        reach = self.tree_reach(parents, confidences)
        best = sorted(range(len(reach)), key=lambda i: (-reach[i], i))[:total]  # parents before children
        count = self.best_length([reach[i] for i in best])
        self.settle(count > 0 and self.pays(sum(reach[i] for i in best[:count]), count, steps=steps))
        return sorted(best[:count]), confidences

    def record_tree(self, drafted: list[int], parents: list[int], confidences: list[float], written: list[int]) -> None:
        """Score a tree, verified or not, against what the target then wrote from its root: below each node of the
        written path every child is decided (the one with the written token matched, its siblings did not)."""
        kids = children(torch.tensor(parents, dtype=torch.long))
        row, level, decided, matches = 0, 0, [], []
        while level < len(written) and kids[row]:
            hit = next((c for c in kids[row] if drafted[c] == written[level]), None)
            decided += [confidences[c] for c in kids[row]]
            matches += [c == hit for c in kids[row]]
            if hit is None:
                break
            row, level = hit + 1, level + 1
        self.record(decided, matches)


def node_confidences(parents: list[int], scores: list[float]) -> list[float]:
    """Each tree node's own draft probability, from the cumulative log-probabilities of it and its parent."""
    return [math.exp(s - (scores[p] if p >= 0 else 0.0)) for s, p in zip(scores, parents, strict=True)]


@dataclass(frozen=True)
class Costs:
    forward_costs: tuple[float, ...]
    step_cost: float


def measure_costs(
    target_forward: Callable[[int], None], drafter_step: Callable[[], None], max_new_tokens: int = 9
) -> Costs:
    """The budget's costs on this machine, in units of a one-token target forward.

    `target_forward(n)` runs (and rolls back) one target forward over n new tokens on a warm cache; `drafter_step()`
    one drafter step. Sizes 1..max_new_tokens are interleaved and medians of 5 taken, so a busy moment hits all of
    them alike."""
    sizes = range(1, max_new_tokens + 1)
    for n in sizes:  # warm-up: first calls allocate
        target_forward(n)
    drafter_step()
    times: dict[int, list[float]] = {n: [] for n in sizes}
    steps: list[float] = []
    for _ in range(5):
        for n in sizes:
            start = time.perf_counter()
            target_forward(n)
            times[n].append(time.perf_counter() - start)
        start = time.perf_counter()
        drafter_step()
        steps.append(time.perf_counter() - start)
    one = statistics.median(times[1])
    return Costs(
        forward_costs=tuple(statistics.median(times[n]) / one for n in sizes),
        step_cost=statistics.median(steps) / one,
    )


def measured_budget(
    target, drafter_step: Callable[[], None], context: int = 128, max_new_tokens: int = 9
) -> DraftBudget:
    """A `DraftBudget` whose costs are timed on this machine against `target` with a `context`-token cache."""
    from draftsmith.decode.cache import rollback

    cache = target.new_cache()
    prompt = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        target.forward(prompt, cache, logits_to_keep=1)

    def forward(n: int) -> None:
        with torch.inference_mode():
            target.forward(prompt[:n], cache)
        rollback(cache, context)

    costs = measure_costs(forward, drafter_step, max_new_tokens)
    return DraftBudget(forward_costs=costs.forward_costs, step_cost=costs.step_cost)
