import torch

from draftsmith.drafters.budget import DraftBudget
from draftsmith.drafters.ngram import PRIOR_REACH, NgramDrafter

GEN = torch.Generator()
ALWAYS = DraftBudget.fixed()  # propose every lookup in full
STEEP = DraftBudget(forward_costs=(1.0, 1.6, 2.2, 2.8, 3.4), step_cost=0.0)  # each drafted token costs 0.6 of a step


def propose(drafter, tokens, k=4):
    return drafter.propose(torch.tensor(tokens), k, 0.0, GEN).tokens.tolist()


def test_longest_suffix_match_uses_latest_occurrence():
    d = NgramDrafter(min_ngram=1, max_ngram=3, budget=ALWAYS)
    # suffix [7, 8] occurred twice; the latest occurrence is followed by 9, 10
    assert propose(d, [7, 8, 1, 2, 7, 8, 9, 10, 3, 7, 8]) == [9, 10, 3, 7]
    # longest match wins: [5, 6, 7] matches once (followed by 1), [6, 7] later (followed by 2)
    assert propose(d, [5, 6, 7, 1, 6, 7, 2, 5, 6, 7]) == [1, 6, 7, 2]
    assert propose(d, [1, 2, 3, 4]) == []  # nothing repeats


def test_draft_is_capped_at_max_tokens():
    d = NgramDrafter(budget=ALWAYS)
    assert propose(d, [1, 2, 3, 4, 5, 6, 1, 2], k=2) == [3, 4]


def test_lookups_are_scored_against_the_generated_text():
    d = NgramDrafter(min_ngram=1, max_ngram=1, budget=STEEP, prior_weight=2, decay=1.0)
    text = [1, 2, 3, 1]
    propose(d, text)  # unigram [1] -> [2, 3, 1], what followed it last time
    # The target wrote 2, 9: the lookup gained one token. Scored when the divergence shows.
    assert propose(d, text + [2, 9]) == []  # [9] never seen: no lookup, but the first one is settled
    outcomes = d.outcomes[1]
    assert outcomes.lookups == 3
    assert outcomes.reached[0] == 2 * PRIOR_REACH + 1 and outcomes.reached[1] == 2 * PRIOR_REACH**2


def test_the_prefix_that_pays_is_proposed_and_the_rest_cut():
    """A table where a second drafted token is nearly free and a third costs a whole step (the CPU's step from
    3 to 4 rows, exaggerated): a lookup that keeps matching is proposed 2 tokens long, not 4."""
    stepped = DraftBudget(forward_costs=(1.0, 1.05, 1.1, 2.1, 2.15), step_cost=0.0)
    d = NgramDrafter(min_ngram=1, max_ngram=1, budget=stepped, decay=1.0)
    loop = [1, 2, 3, 4, 5]
    for _ in range(8):  # a loop: every lookup matches in full
        loop = loop + loop[:5]
        propose(d, loop)
    assert propose(d, loop) == [1, 2]
    assert propose(NgramDrafter(min_ngram=1, max_ngram=1, budget=ALWAYS), loop) == [1, 2, 3, 4]


def test_silent_lengths_are_still_measured_and_speak_up_again():
    d = NgramDrafter(min_ngram=1, max_ngram=1, budget=STEEP, prior_weight=2, decay=1.0)
    text = [5, 6, 7, 5]
    assert propose(d, text) == []  # prior: a first token matches half the time, not worth 0.6 of a step
    assert propose(d, text + [8]) == []  # the lookup missed at once: P(first token) (1 + 0) / 3
    assert d.outcomes[1].reaches(1)[0] < 0.6
    # The text becomes a loop; silent lookups keep being scored, gain fully, and the drafter proposes again.
    loop = text + [8]
    for _ in range(6):
        propose(d, loop)
        loop = loop + loop[-5:]
    assert d.outcomes[1].reaches(1)[0] > 0.6
    assert propose(d, loop)


def test_begin_forgets_open_lookups_but_keeps_outcomes():
    d = NgramDrafter(min_ngram=1, max_ngram=1, budget=ALWAYS, decay=1.0)
    propose(d, [1, 2, 1])
    d.begin(torch.tensor([1]), None)
    before = d.outcomes[1].lookups
    propose(d, [3, 4])  # a new sequence: the old lookup must not be scored against it
    assert d.outcomes[1].lookups == before
