import torch

from draftsmith.drafters.ngram import NgramDrafter

GEN = torch.Generator()


def propose(drafter, tokens, k=4):
    return drafter.propose(torch.tensor(tokens), k, 0.0, GEN).tokens.tolist()


def test_longest_suffix_match_uses_latest_occurrence():
    d = NgramDrafter(min_ngram=1, max_ngram=3, break_even=0.0)
    # suffix [7, 8] occurred twice; the latest occurrence is followed by 9, 10
    assert propose(d, [7, 8, 1, 2, 7, 8, 9, 10, 3, 7, 8]) == [9, 10, 3, 7]
    # longest match wins: [5, 6, 7] matches once (followed by 1), [6, 7] later (followed by 2)
    assert propose(d, [5, 6, 7, 1, 6, 7, 2, 5, 6, 7]) == [1, 6, 7, 2]
    assert propose(d, [1, 2, 3, 4]) == []  # nothing repeats


def test_draft_is_capped_at_max_tokens():
    d = NgramDrafter(break_even=0.0)
    assert propose(d, [1, 2, 3, 4, 5, 6, 1, 2], k=2) == [3, 4]


def test_lookups_are_scored_against_the_generated_text():
    d = NgramDrafter(min_ngram=1, max_ngram=1, break_even=0.6, prior_weight=2, decay=1.0)
    text = [1, 2, 3, 1]
    assert propose(d, text) == [2, 3, 1]  # unigram [1] -> what followed it last time
    # The target wrote 2, 9: the draft would have gained one token. Scored when the divergence shows.
    assert propose(d, text + [2, 9]) == []  # [9] never seen: no lookup, but the first one is settled
    assert d.yields[1].lookups == 3 and d.yields[1].gained == 1.2 + 1


def test_silent_lengths_are_still_measured_and_speak_up_again():
    d = NgramDrafter(min_ngram=1, max_ngram=1, break_even=0.6, prior_weight=2, decay=1.0)
    text = [5, 6, 7, 5]
    assert propose(d, text) == [6, 7, 5]
    assert propose(d, text + [8]) == []  # the draft missed at once: yield (1.2 + 0) / 3 = 0.4 -> silent
    assert d.yields[1].mean < 0.6
    # The text becomes a loop; silent lookups keep being scored, gain fully, and the drafter proposes again.
    loop = text + [8]
    for _ in range(6):
        propose(d, loop)
        loop = loop + loop[-5:]
    assert d.yields[1].mean > 0.6
    assert propose(d, loop)


def test_begin_forgets_open_lookups_but_keeps_yields():
    d = NgramDrafter(min_ngram=1, max_ngram=1, break_even=0.0, decay=1.0)
    propose(d, [1, 2, 1])
    d.begin(torch.tensor([1]), None)
    before = d.yields[1].lookups
    propose(d, [3, 4])  # a new sequence: the old lookup must not be scored against it
    assert d.yields[1].lookups == before
