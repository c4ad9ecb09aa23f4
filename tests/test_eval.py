"""`draftsmith eval`: the report's fields and meaning, the CLI's errors, and SmolLM2 end to end."""

import json

import pytest
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.config import EvalConfig
from draftsmith.data.sources import Conversation
from draftsmith.drafters.budget import DraftBudget
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.errors import TargetError
from draftsmith.evaluate import evaluate, write_report
from tests.conftest import tiny_target

REQUIRED = {
    "target": str,
    "drafter": str,
    "dataset": str,
    "prompts": int,
    "max_new_tokens": int,
    "new_tokens": int,
    "target_forwards": int,
    "temperature": float,
    "acceptance_length": float,
    "acceptance_by_position": list,
    "spec_tokens_per_s": float,
    "baseline_tokens_per_s": float,
    "speedup": float,
    "mismatches": int,
}


def chats(*texts: str) -> list[Conversation]:
    return [Conversation(id=f"p{i}", messages=[{"role": "user", "content": t}]) for i, t in enumerate(texts)]


def test_report_fields_and_meaning(tmp_path):
    target = tiny_target(5)
    prompts = chats("t5 t9 t5 t9 t5", "t7 t8 t7 t8", "t30 t31 t32")
    cfg = EvalConfig(max_new_tokens=24, num_draft_tokens=3, out=tmp_path)
    report = evaluate(target, NgramDrafter(budget=DraftBudget.fixed()), "toy", prompts, cfg)
    for key, kind in REQUIRED.items():
        assert isinstance(report[key], kind), key
    assert report["mismatches"] == 0
    assert report["prompts"] == 3 and len(report["acceptance_by_position"]) == 3
    assert report["acceptance_length"] == pytest.approx(report["new_tokens"] / report["target_forwards"])
    assert report["speedup"] == pytest.approx(report["spec_tokens_per_s"] / report["baseline_tokens_per_s"])
    assert all(0.0 <= p <= 1.0 for p in report["acceptance_by_position"])
    write_report(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert "| acceptance length" in (tmp_path / "report.md").read_text()


def test_sampling_report_has_no_mismatch_count(tmp_path):
    cfg = EvalConfig(max_new_tokens=8, temperature=0.8, out=tmp_path)
    report = evaluate(tiny_target(5), NgramDrafter(), "toy", chats("t5 t6"), cfg)
    assert report["mismatches"] is None and report["temperature"] == 0.8


def test_prompt_longer_than_context_names_the_prompt():
    long = " ".join(["t7"] * 300)
    with pytest.raises(TargetError, match="prompt 'p1' of toy .* exceeds the context"):
        evaluate(tiny_target(0), NgramDrafter(), "toy", chats("t5", long), EvalConfig(max_new_tokens=8))


def run_cli(*args: str):
    return CliRunner().invoke(app, ["eval", *args])


def test_cli_rejects_bad_options_before_loading_anything(tmp_path):
    result = run_cli("--num-draft-tokens", "0")
    assert result.exit_code == 2 and "num_draft_tokens" in result.output and "hint" in result.output
    result = run_cli("--dataset", str(tmp_path / "missing.jsonl"))
    assert result.exit_code == 2 and "missing.jsonl" in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    result = run_cli("--dataset", str(bad))
    assert result.exit_code == 2 and "bad.jsonl" in result.output and "bad.jsonl:2" in result.output
    result = run_cli("--drafter", "magic")
    assert result.exit_code == 2 and "unknown drafter" in result.output


def test_cli_refuses_a_replayed_fixed_chain_when_sampling_before_the_target_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("draftsmith.target.load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    result = run_cli("--fixed-chain", "replayed", "--temperature", "0.7", "--out", str(tmp_path / "eval"))
    assert result.exit_code == 2 and "replayed needs --temperature 0" in result.output


@pytest.mark.integration
def test_smollm2_greedy_speculation_is_identical_to_generate(smollm2, tmp_path):
    prompts = chats(
        "List three facts about the Moon, then repeat the list in reverse order.",
        "Write a Python function that returns the n-th Fibonacci number, and explain it.",
    )
    cfg = EvalConfig(max_new_tokens=64, num_draft_tokens=5, out=tmp_path)
    report = evaluate(smollm2, NgramDrafter(budget=DraftBudget.fixed()), "integration", prompts, cfg)
    assert report["mismatches"] == 0, report["per_prompt"]
    assert report["acceptance_length"] > 1.0  # an always-proposing n-gram drafter lands some tokens


@pytest.mark.integration
def test_cli_eval_end_to_end(smollm2, tmp_path):
    result = run_cli("--limit", "2", "--max-new-tokens", "16", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dataset"] == "builtin" and report["prompts"] == 2 and report["mismatches"] == 0


def test_learned_drafter_reports_fixed_chain_next_to_adaptive(tmp_path, capsys):
    """`eval` of a trained EAGLE-3 run measures, in one run against one baseline, the adaptive budget (the main
    fields) and the same drafter with a fixed chain (`*_fixed`), both lossless; drafting deeper than the drafter
    was trained warns once, before any work."""
    from draftsmith.stages import evaluate as run_eval
    from draftsmith.train import TrainConfig
    from tests.test_train import run, setup

    target, data, weights, config = setup(count=6)
    run(TrainConfig(max_steps=4, batch_size=2, ttt_steps=2, val_fraction=0), data, weights, config, tmp_path / "run")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t5 t9", "category": "a"}\n{"prompt": "t7 t8 t7", "category": "b"}\n')
    cfg = EvalConfig(drafter=str(tmp_path / "run"), dataset=str(prompts), max_new_tokens=16, num_draft_tokens=3,
                     out=tmp_path / "eval")  # fmt: skip
    (report,) = run_eval(cfg, target)
    assert "more than the 2 draft steps" in capsys.readouterr().err
    assert report["mismatches"] == 0 and report["mismatches_fixed"] == 0
    assert 1.0 <= report["acceptance_length_fixed"] <= 4.0
    assert report["drafts_by_position_fixed"][0] > 0  # the fixed chain drafts every round
    assert len(report["acceptance_by_position_fixed"]) == 3
    assert "fixed chain: acceptance length" in (tmp_path / "eval" / "report.md").read_text()
    # by kind of prompt: each kind's own tokens per forward, for both policies
    assert report["by_kind"].keys() == report["by_kind_fixed"].keys() == {"a", "b"}
    runs = {p["kind"]: p for p in report["per_prompt"]}
    assert report["by_kind"]["a"]["acceptance_length"] == pytest.approx(runs["a"]["acceptance_length"])


def test_a_replayed_fixed_chain_accepts_what_the_timed_one_does(tmp_path):
    """At T=0 `fixed_chain: replayed` replays the twin along the baseline's text instead of decoding: the same
    acceptance, round for round, as the timed run, no speed figures; the other drafters keep their reports; with
    sampling it is refused before any work."""
    from draftsmith.errors import ConfigError
    from draftsmith.stages import evaluate as run_eval
    from draftsmith.train import TrainConfig
    from tests.test_train import run, setup

    target, data, weights, config = setup(count=6)
    run(TrainConfig(max_steps=30, batch_size=2, ttt_steps=3, lr=3e-3, val_fraction=0), data, weights, config,
        tmp_path / "run")  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{p}", "category": "{k}"}}\n' for p, k in
                               [("t5 t9 t5 t9", "a"), ("t7 t8 t7", "b"), ("t3 t4 t5 t6", "a")]))  # fmt: skip
    reports = {}
    for mode in ("timed", "replayed"):
        cfg = EvalConfig(drafter=str(tmp_path / "run"), dataset=str(prompts), max_new_tokens=24, num_draft_tokens=3,
                         compare=["ngram"], fixed_chain=mode, out=tmp_path / mode)  # fmt: skip
        reports[mode], ngram = run_eval(cfg, target)
        assert ngram["drafter"].startswith("ngram") and ngram["mismatches"] == 0
    timed, replayed = reports["timed"], reports["replayed"]
    assert replayed["fixed_chain"] == "replayed" and replayed["speedup_fixed"] is None
    assert sum(timed["acceptance_by_position_fixed"]) > 0  # the drafter accepts something, so the check means much
    for key in ("acceptance_length_fixed", "acceptance_by_position_fixed", "drafts_by_position_fixed"):
        assert replayed[key] == pytest.approx(timed[key]), key
    assert replayed["by_kind_fixed"] == timed["by_kind_fixed"]
    assert "fixed chain: speedup | - |" in (tmp_path / "replayed" / "report.md").read_text()
    sampled = EvalConfig(drafter=str(tmp_path / "run"), dataset=str(prompts), temperature=0.7, fixed_chain="replayed",
                         out=tmp_path / "sampled")  # fmt: skip
    with pytest.raises(ConfigError, match="replayed needs --temperature 0"):
        run_eval(sampled, target)


def test_smollm2_tree_speculation_is_identical_to_generate(smollm2, tmp_path):
    """Tree verification through the real model's 4-D mask path, with its oneDNN-packed weights."""
    from draftsmith.decode.tree import TreeShape
    from draftsmith.packed import PackedLinear

    assert any(isinstance(m, PackedLinear) for m in smollm2.model.modules())
    prompts = chats(
        "List three facts about the Moon, then repeat the list in reverse order.",
        "Write a Python function that returns the n-th Fibonacci number, and explain it.",
    )
    cfg = EvalConfig(max_new_tokens=64, out=tmp_path)
    drafter = NgramDrafter(budget=DraftBudget.fixed(), tree=TreeShape(5, 3, 12))
    report = evaluate(smollm2, drafter, "integration", prompts, cfg.model_copy(update={"num_draft_tokens": 12}))
    assert report["mismatches"] == 0, report["per_prompt"]
    assert report["acceptance_length"] > 1.0


def test_learned_drafter_tree_reports_its_chains_side_by_side(tmp_path):
    """`eval --tree`: the tree (main fields), the fixed chain (`*_fixed`) and the adaptive chain (`*_adaptive`) of
    the same drafter, one run, one baseline, all lossless; with `fixed_chain: replayed` the fixed chain accepts, round
    for round, what the timed one does."""
    from draftsmith.stages import evaluate as run_eval
    from draftsmith.train import TrainConfig
    from tests.test_train import run, setup

    target, data, weights, config = setup(count=6)
    run(TrainConfig(max_steps=4, batch_size=2, ttt_steps=2, val_fraction=0), data, weights, config, tmp_path / "run")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t5 t9", "category": "a"}\n{"prompt": "t7 t8 t7", "category": "b"}\n')
    tune = tmp_path / "tune.json"  # as `draftsmith tune` writes it: the best shape and the table
    rows = [{"shape": "depth=3,topk=2,total=6", "depth": 3, "topk": 2, "total": 6, "tokens_per_s": 30.0},
            {"shape": "depth=2,topk=1,total=2", "depth": 2, "topk": 1, "total": 2, "tokens_per_s": 20.0}]  # fmt: skip
    tune.write_text(json.dumps({"best": rows[0], "shapes": rows, "baseline_tokens_per_s": 16.0}))
    cfg = EvalConfig(drafter=str(tmp_path / "run"), dataset=str(prompts), max_new_tokens=16, num_draft_tokens=2,
                     tree=str(tune), out=tmp_path / "eval")  # fmt: skip
    (report,) = run_eval(cfg, target)
    assert report["tree"] == "depth=3,topk=2,total=6" and report["num_draft_tokens"] == 6
    assert report["predicted_tokens_per_s"] == 30.0 and report["predicted_tokens_per_s_fixed"] == 20.0
    assert report["predicted_speedup"] == 30.0 / 16.0 and report["predicted_speedup_fixed"] == 20.0 / 16.0
    assert report["mismatches"] == report["mismatches_fixed"] == report["mismatches_adaptive"] == 0
    assert len(report["acceptance_by_position"]) == 6 and len(report["acceptance_by_position_fixed"]) == 2
    text = (tmp_path / "eval" / "report.md").read_text()
    assert "fixed chain: acceptance length" in text and "adaptive chain: speedup" in text
    assert "| tune predicted: fixed chain: speedup | 1.25x |" in text
    assert "| draft position (fixed chain) |" in text
    (replayed,) = run_eval(cfg.model_copy(update={"fixed_chain": "replayed", "out": tmp_path / "replayed"}), target)
    assert replayed["fixed_chain"] == "replayed" and replayed["speedup_fixed"] is None
    assert replayed["mismatches"] == replayed["mismatches_adaptive"] == 0
    assert sum(report["acceptance_by_position_fixed"]) > 0  # the chain accepts something, so the check means much
    for key in ("acceptance_length_fixed", "acceptance_by_position_fixed", "drafts_by_position_fixed"):
        assert replayed[key] == pytest.approx(report[key]), key
