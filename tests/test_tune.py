"""`tune`: its replay of acceptance matches the engine's own decoding, and bad tree input fails in one line."""

import pytest
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.tree import TreeShape
from draftsmith.drafters import with_tree
from draftsmith.drafters.base import NullDrafter
from draftsmith.drafters.budget import DraftBudget
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.tune import candidate_shapes, record, replay, static_rank_tree, tune
from tests.conftest import tiny_target
from tests.test_eagle3 import make_model


@pytest.mark.parametrize("shape", [TreeShape(3, 1, 3), TreeShape(3, 2, 6), TreeShape(4, 3, 12)])
@pytest.mark.parametrize("kind", ["eagle3", "ngram"])
def test_replay_counts_the_rounds_the_engine_runs(shape, kind):
    """At T=0 replaying a shape over the target's text gives exactly the engine's rounds and accepted tokens."""
    target = tiny_target(2)
    base = Eagle3Drafter(make_model(target, seed=2)) if kind == "eagle3" else NgramDrafter(budget=DraftBudget.fixed())
    drafter = with_tree(base, shape)
    prompt = [0, 5, 9, 5, 9, 12, 5, 9, 14]
    out = SpeculativeDecoder(target, drafter, shape.total).generate(prompt, 40)
    run = record(target, drafter, prompt, 40)
    assert run.text == out.tokens
    sizes, paths, _ = replay(drafter, run, shape.total)
    assert len(sizes) + 1 == out.target_forwards
    assert sum(len(p) for p in paths) == sum(out.accepted[:1]) + sum(out.accepted[1:])


def test_tune_ranks_shapes_by_predicted_speed():
    target = tiny_target(3)
    base = Eagle3Drafter(make_model(target, seed=3))
    shapes = candidate_shapes([3], [2], [4, 6], [2, 3])
    assert [str(s) for s in shapes] == ["depth=2,topk=1,total=2", "depth=3,topk=1,total=3"] + [
        "depth=3,topk=2,total=4",
        "depth=3,topk=2,total=6",
    ]
    report = tune(target, lambda s: with_tree(base, s), [[0, 5, 9, 14], [0, 7, 3]], shapes, 16, log=lambda _: None)
    speeds = [row["tokens_per_s"] for row in report["shapes"]]
    assert speeds == sorted(speeds, reverse=True) and report["best"] == report["shapes"][0]
    assert all(row["acceptance_length"] >= 1.0 for row in report["shapes"])
    assert set(report["verify_ms"]) == set(range(1, 65))


def test_static_rank_tree_keeps_prefixes():
    paths = [(0, 0, 1), (0, 0), (1,), (0,), (), (0, 2)]
    assert static_rank_tree(paths, 4) == [(0,), (1,), (0, 0), (0, 2)]  # ties: shorter first
    assert static_rank_tree([(0, 0, 1)] * 3 + [(1,)], 3) == [(0,), (0, 0), (0, 0, 1)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval", "--tree", "depth=2,topk=2,total=9"], "hold at most 6"),
        (["eval", "--tree", "depth=-3,topk=2"], "positive"),
        (["serve", "--tree", "depth=3,topk=two"], "bad tree shape"),
        (["tune", "--topks", "2,x"], "comma-separated"),
    ],
)
def test_bad_tree_input_is_a_one_line_error(args, message):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error")]) == 1


def test_topk_larger_than_the_draft_vocabulary_fails_when_the_tree_is_set():
    target = tiny_target(0)
    drafter = Eagle3Drafter(make_model(target, draft_size=48))
    with pytest.raises(Exception, match="larger than the draft vocabulary"):
        with_tree(drafter, TreeShape(2, 49, 10))
    with pytest.raises(Exception, match="cannot draft trees"):
        with_tree(NullDrafter(), TreeShape(2, 2, 4))


def test_tree_auto_tunes_and_returns_a_shape(capsys):
    from draftsmith.tune import resolve_tree

    shape = resolve_tree("auto", tiny_target(1), "ngram")
    assert isinstance(shape, TreeShape)
    assert f"--tree auto: {shape}" in capsys.readouterr().out
    assert resolve_tree(None, tiny_target(1), "ngram") is None
    assert resolve_tree("depth=2,topk=2", tiny_target(1), "ngram") == TreeShape(2, 2, 6)
