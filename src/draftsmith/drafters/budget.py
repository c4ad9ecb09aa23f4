"""How long a draft chain should be: stop where the next token no longer pays for itself.

Cost model of one speculative round, in units of one plain decode step (a target forward over one token):

    verify_cost      a forward over the last token + a one-token draft (CPU fp32, SmolLM2, packed weights: 1.09-1.13)
    token_cost       each further draft token in that forward (~0.05), and `step_cost` for the drafter's own step
                     that makes a token (~0.065: ~4 ms against a 62-73 ms target step; `benchmarks/verify_cost.py`)

A chain whose i-th token is accepted with probability P_i (the product of the drafter's per-step confidences)
yields 1 + sum(P_i) tokens. Drafting continues while the next token's P_i exceeds its own cost, and the chain is
proposed only if it beats plain decoding: 1 + sum(P_i) >= verify_cost + k * (token_cost + step_cost). After a chain
that does not pay, the drafter rests for a growing number of rounds (its context positions are run later, in one
batch), so on text it cannot predict it costs almost nothing.
Confidences come from the drafter's softmax, which is only roughly calibrated (worse on unfamiliar text), so they
are scaled by the recent ratio of accepted to predicted tokens. On a GPU, where verifying a few extra tokens is
nearly free, `verify_cost` ~ 1 and the costs ~ 0 give the fixed full-length chain.
"""

from dataclasses import dataclass


@dataclass
class DraftBudget:
    verify_cost: float = 1.15
    token_cost: float = 0.05
    step_cost: float = 0.065
    decay: float = 0.95  # weight of older rounds in the calibration
    predicted: float = 4.0  # decayed sums of predicted and accepted draft tokens: a prior of a few rounds at 1:1
    accepted: float = 4.0
    max_rest: int = 16  # most rounds to stay silent after drafts that did not pay
    backoff: int = 0
    resting_for: int = 0

    @classmethod
    def fixed(cls) -> "DraftBudget":
        """Always draft the full length (tests, GPU engines)."""
        return cls(verify_cost=0.0, token_cost=0.0, step_cost=0.0)

    @property
    def scale(self) -> float:
        return self.accepted / self.predicted if self.predicted > 0 else 1.0

    def reach(self, previous: float, confidence: float) -> float:
        """Calibrated chance that the chain is accepted up to and including a token drafted with `confidence`,
        given the chance `previous` that it got that far."""
        return previous * min(1.0, confidence * self.scale)

    def continues(self, reach: float) -> bool:
        """Is the token worth drafting and verifying, given the chance P that it is reached and accepted?"""
        return reach >= self.token_cost + self.step_cost

    def pays(self, expected: float, length: int) -> bool:
        """Does a chain of `length` tokens with `expected` accepted ones beat one plain decode step?"""
        return 1.0 + expected >= self.verify_cost + length * (self.token_cost + self.step_cost)

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

    def record(self, predicted: float, accepted: int) -> None:
        """A chain's predicted sum(P_i) against the tokens the target actually produced, proposed or not."""
        self.predicted = self.decay * self.predicted + predicted
        self.accepted = self.decay * self.accepted + accepted
