"""The draft budget: its arithmetic, its calibration against what the target accepts, and its measured costs."""

import random

import pytest
import torch

from draftsmith.drafters.budget import DraftBudget, measure_costs, measured_budget
from draftsmith.drafters.eagle3 import Eagle3Drafter
from tests.conftest import tiny_target
from tests.test_eagle3 import make_model


def test_budget_arithmetic():
    budget = DraftBudget(verify_cost=1.6, token_cost=0.1, step_cost=0.1)
    # A chain of 2 costs verify 1.6 + 1 further token 0.1 + 2 drafter steps 0.2 = 1.9 plain steps.
    assert budget.pays(expected=1.0, length=2) and not budget.pays(expected=0.8, length=2)
    # Once drafted, the 0.2 of drafter steps is spent: the chain is worth its forward (1.7) at 0.8 expected tokens.
    assert budget.worth_verifying(expected=0.8, length=2) and not budget.worth_verifying(expected=0.6, length=2)
    assert budget.continues(0.25) and not budget.continues(0.15)
    budget.record([0.9] * 10, [True, False] * 5)  # overconfident drafts: later confidences are scaled down
    assert budget.reach(1.0, 0.9) < 0.9
    budget.settle(paid=False)
    assert [budget.resting() for _ in range(2)] == [True, False]
    budget.settle(paid=False)
    assert [budget.resting() for _ in range(3)] == [True, True, False]
    fixed = DraftBudget.fixed()
    assert fixed.is_fixed and fixed.pays(0.0, 7) and fixed.continues(0.0)
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


def test_measure_costs_fits_a_linear_verify_cost():
    """Synthetic forwards costing 10 ms + 1 ms per extra token and a 2 ms drafter step: the fit recovers the model."""
    import time

    def forward(n: int) -> None:
        time.sleep(0.010 + 0.001 * (n - 1))

    costs = measure_costs(forward, lambda: time.sleep(0.002))
    assert costs.verify_cost == pytest.approx(1.1, abs=0.08)
    assert costs.token_cost == pytest.approx(0.1, abs=0.05)
    assert costs.step_cost == pytest.approx(0.2, abs=0.08)


def test_measured_budget_on_a_real_target():
    target = tiny_target(1)
    drafter = Eagle3Drafter(make_model(target))
    budget = measured_budget(target, drafter.step_probe(), context=16)
    assert 0.0 < budget.step_cost < 100.0 and budget.verify_cost < 100.0  # timed, in units of a target step
    assert not budget.is_fixed
