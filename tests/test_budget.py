"""The draft budget: its arithmetic, its calibration against what the target accepts, and its measured costs."""

import random

import pytest
import torch

from draftsmith.drafters.budget import DraftBudget, linear_costs, measure_costs, measured_budget
from draftsmith.drafters.eagle3 import Eagle3Drafter
from tests.conftest import tiny_target
from tests.test_eagle3 import make_model


def test_budget_arithmetic():
    budget = DraftBudget(forward_costs=linear_costs(1.6, 0.1), step_cost=0.1)
    # A chain of 2 costs a forward over 3 tokens (1.7) + 2 drafter steps (0.2) = 1.9 plain steps.
    assert budget.pays(expected=1.0, length=2) and not budget.pays(expected=0.8, length=2)
    assert budget.pays(expected=0.85, length=2, steps=1)  # a block drafter (DFlash) spends one step for both
    # The first token adds 0.6 to the forward and a step; each further one 0.1 and a step.
    assert budget.continues(0.75, 0) and not budget.continues(0.65, 0)
    assert budget.continues(0.25, 1) and not budget.continues(0.15, 1)
    # Verify the prefix with the most expected tokens per forward: 2.4 / 1.7 beats 1.9 / 1.6 and 2.45 / 1.8.
    assert budget.best_length([0.9, 0.5, 0.05]) == 2
    assert budget.best_length([0.5]) == 0  # 1.5 tokens for 1.6 steps: a plain step does better
    budget.record([0.9] * 10, [True, False] * 5)  # overconfident drafts: later confidences are scaled down
    assert budget.reach(1.0, 0.9) < 0.9
    budget.settle(paid=False)
    assert [budget.resting() for _ in range(2)] == [True, False]
    budget.settle(paid=False)
    assert [budget.resting() for _ in range(3)] == [True, True, False]
    fixed = DraftBudget.fixed()
    assert fixed.is_fixed and fixed.pays(0.0, 7) and fixed.continues(0.0, 3) and fixed.best_length([0.0] * 4) == 4
    assert not DraftBudget().is_fixed


@pytest.mark.parametrize(("ratio", "low", "high"), [(0.5, 0.2, 0.95), (1.5, 0.1, 0.6)])
def test_scale_converges_to_the_true_acceptance_ratio(ratio, low, high):
    """A drafter whose token at confidence c is accepted with probability ratio * c: the drafter's own scoring of
    its chains against what the target wrote drives the scale to `ratio` (within 5 %), from a 1:1 prior."""
    target = tiny_target(1)
    drafter = Eagle3Drafter(make_model(target), budget=DraftBudget())
    rng = random.Random(0)
    scales = []
    for round_ in range(4000):
        confidences = [rng.uniform(low, high) for _ in range(4)]
        chain = [rng.randrange(1, 90) for _ in confidences]
        written = []
        for c, token in zip(confidences, chain, strict=True):
            if rng.random() < ratio * c:
                written.append(token)
            else:
                written.append(0 if token != 0 else 1)  # the target wrote something else: the chain ends here
                break
        written += [rng.randrange(90)] * (len(chain) - len(written))
        start = 10
        drafter.last_chain = (start, chain, confidences)
        drafter._score_last_chain(torch.tensor([5] * start + written))
        if round_ >= 2000:
            scales.append(drafter.budget.scale)
    mean = sum(scales) / len(scales)
    assert abs(mean - ratio) < 0.05 * ratio, mean


def test_scale_uses_only_decided_tokens():
    """Only tokens up to the first mismatch, and only those the target has written so far, are scored."""
    budget = DraftBudget(confidence=0.0, matched=0.0, decay=1.0)
    drafter = Eagle3Drafter(make_model(tiny_target(1)), budget=budget)
    drafter.last_chain = (2, [7, 8, 9], [0.5, 0.5, 0.5])
    drafter._score_last_chain(torch.tensor([1, 1, 7, 3, 9]))  # 7 matched, 8 did not; 9 is not decided
    assert (budget.matched, budget.confidence) == (1.0, 1.0)
    drafter.last_chain = (2, [7, 8, 9], [0.4, 0.4, 0.4])
    drafter._score_last_chain(torch.tensor([1, 1, 7]))  # one token written yet: only the first is decided
    assert budget.matched == pytest.approx(2.0) and budget.confidence == pytest.approx(1.4)


def test_a_step_shaped_cost_table_is_followed_not_smoothed():
    """An AMX Xeon's measured shape: 2-3 token forwards cheaper than one, a jump at 4. The budget verifies 1-2
    drafts at a confidence a line through the points would refuse, and stops before the jump unless it pays."""
    budget = DraftBudget(forward_costs=(1.0, 0.85, 0.89, 1.14), step_cost=0.05)
    assert budget.best_length([0.2]) == 1  # 1.2 tokens for 0.85 of a step
    assert budget.best_length([0.6, 0.3, 0.1]) == 2  # 1.9 / 0.89 beats 2.0 / 1.14
    assert budget.continues(0.1, 1) and not budget.continues(0.25, 2)  # the 4th row adds 0.25
    assert budget.forward_cost(6) == pytest.approx(1.14 + 2 * 0.25)  # past the table: its last step per token


def test_measure_costs_times_each_forward_size():
    """Synthetic forwards costing 30 ms up to 3 tokens and 42 ms from 4, and a 6 ms drafter step: the table keeps
    the step (a line would not)."""
    import time

    def forward(n: int) -> None:
        time.sleep(0.030 if n <= 3 else 0.042)

    costs = measure_costs(forward, lambda: time.sleep(0.006), max_new_tokens=5)
    assert costs.forward_costs == pytest.approx((1.0, 1.0, 1.0, 1.4, 1.4), abs=0.1)
    assert costs.step_cost == pytest.approx(0.2, abs=0.08)


def test_measured_budget_on_a_real_target():
    target = tiny_target(1)
    drafter = Eagle3Drafter(make_model(target))
    budget = measured_budget(target, drafter.step_probe(), context=16)
    assert 0.0 < budget.step_cost < 100.0 and 0.0 < max(budget.forward_costs) < 100.0  # timed, in target steps
    assert len(budget.forward_costs) == 9 and budget.forward_costs[0] == 1.0
    assert not budget.is_fixed
