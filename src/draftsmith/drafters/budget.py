"""How long a draft chain should be: stop where the next token no longer pays for itself.

Cost model of one speculative round, in units of one plain decode step (a target forward over one token):

    verify_cost      a forward over the last token + a one-token draft (CPU fp32, SmolLM2, packed weights: ~1.1)
    token_cost       each further draft token in that forward (~0.05), and `step_cost` for the drafter's own step
                     that makes a token (~0.065 on the same CPU)

The costs belong to the machine that decodes: `measure_costs` times them there at load (about a second) instead
of trusting constants measured elsewhere; on a GPU they come out near (1, 0, ~0), i.e. the fixed full chain.

A chain whose i-th token is accepted with probability P_i (the product of the drafter's per-step confidences)
yields 1 + sum(P_i) tokens. Drafting continues while the next token's P_i exceeds its own cost, and the chain is
verified if it is worth its forward: 1 + sum(P_i) >= verify_cost + (k - 1) * token_cost (the drafter's steps are
spent by then). A chain *pays* only if it also covers those steps: + k * step_cost. After a chain that does not pay,
the drafter rests for a growing number of rounds (its context positions are run later, in one batch), so on text it
cannot predict it costs almost nothing.

Calibration. The drafter's softmax confidence c is only roughly calibrated (worse on unfamiliar text), so the
model is P(token accepted | the chain reached it) = min(1, scale * c). `record` gets, for every drafted token whose
fate the target has decided — the tokens up to and including the first mismatch — its *raw* confidence and whether
it matched; scale = (decayed) matches / (decayed) raw confidences, a ratio estimator that converges to the true
ratio (tests/test_budget.py). Recording already-scaled values instead makes the scale settle near the square root
of the truth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class DraftBudget:
    verify_cost: float = 1.15
    token_cost: float = 0.05
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
        return cls(verify_cost=0.0, token_cost=0.0, step_cost=0.0)

    @property
    def is_fixed(self) -> bool:
        return self.verify_cost == self.token_cost == self.step_cost == 0.0

    @property
    def scale(self) -> float:
        return self.matched / self.confidence if self.confidence > 0 else 1.0

    def reach(self, previous: float, confidence: float) -> float:
        """Calibrated chance that the chain is accepted up to and including a token drafted with `confidence`,
        given the chance `previous` that it got that far."""
        return previous * min(1.0, confidence * self.scale)

    def continues(self, reach: float) -> bool:
        """Is the token worth drafting and verifying, given the chance P that it is reached and accepted?"""
        return reach >= self.token_cost + self.step_cost

    def pays(self, expected: float, length: int) -> bool:
        """Does a chain of `length` tokens with `expected` accepted ones beat one plain decode step? It costs the
        verify forward (which includes the first draft token), the further tokens in it, and a drafter step each."""
        return self.worth_verifying(expected - length * self.step_cost, length)

    def worth_verifying(self, expected: float, length: int) -> bool:
        """Is a chain already drafted worth its verify forward? The drafter's steps are spent either way, so only
        the forward's extra cost counts: a chain may be worth verifying without having paid for its drafting."""
        return 1.0 + expected >= self.verify_cost + (length - 1) * self.token_cost

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

    def record(self, confidences: list[float], matches: list[bool]) -> None:
        """The raw confidences of a chain's decided tokens (up to and including its first mismatch) and whether
        each matched what the target wrote, whether the chain was proposed or not."""
        for c, hit in zip(confidences, matches, strict=True):
            self.confidence = self.decay * self.confidence + c
            self.matched = self.decay * self.matched + hit


@dataclass(frozen=True)
class Costs:
    verify_cost: float
    token_cost: float
    step_cost: float


def measure_costs(
    target_forward: Callable[[int], None], drafter_step: Callable[[], None], sizes: tuple[int, ...] = (1, 2, 3, 5, 9)
) -> Costs:
    """The budget's costs on this machine, in units of a one-token target forward.

    `target_forward(n)` runs (and rolls back) one target forward over n new tokens on a warm cache; `drafter_step()`
    one drafter step. Sizes are interleaved and medians taken, so a busy moment hits all of them alike. The cost of
    n tokens is fitted as verify_cost + (n - 2) * token_cost over n >= 2 (least squares)."""
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
    xs = [n - 2 for n in sizes if n >= 2]
    ys = [statistics.median(times[n]) / one for n in sizes if n >= 2]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / max(
        1e-9, sum((x - mean_x) ** 2 for x in xs)
    )
    slope = max(0.0, slope)
    return Costs(
        verify_cost=max(1.0, mean_y - slope * mean_x), token_cost=slope, step_cost=statistics.median(steps) / one
    )


def measured_budget(target, drafter_step: Callable[[], None], context: int = 128) -> DraftBudget:
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

    costs = measure_costs(forward, drafter_step)
    return DraftBudget(verify_cost=costs.verify_cost, token_cost=costs.token_cost, step_cost=costs.step_cost)
