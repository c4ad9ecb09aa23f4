"""EAGLE-3 training: it learns, resumes exactly, gives the same losses under DDP, and writes its files."""

import json
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Model
from draftsmith.errors import ConfigError, DataError
from draftsmith.formats.load import checkpoint_dir, load_drafter
from draftsmith.train import TrainConfig, train
from draftsmith.train import trainer as trainer_module
from draftsmith.train.losses import ttt_forward, ttt_loss
from draftsmith.train.metrics import read_metrics
from tests.conftest import tiny_target
from tests.test_eagle3 import LAYERS, draft_vocab

NONDETERMINISTIC = {"tokens_per_s"}  # wall-clock; everything else in the log must repeat exactly


def extract(target, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """What the hidden-state store yields, made directly with the target: the first third of each is the prompt."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = int(torch.randint(12, 25, (1,), generator=gen))
        ids = torch.randint(2, target.vocab_size, (length,), generator=gen)
        out = target.forward(ids, target.new_cache(), LAYERS, last_hidden=True)
        mask = torch.zeros(length, dtype=torch.uint8)
        mask[length // 3 :] = 1
        samples.append(
            {"input_ids": ids.int(), "loss_mask": mask, "aux_hidden": out.aux_hidden, "last_hidden": out.last_hidden}
        )
    return samples


def setup(count: int = 6, draft_size: int = 64, seed: int = 0):
    target = tiny_target(seed)
    d2t, t2d = draft_vocab(target.vocab_size, draft_size, seed)
    config = Eagle3Config.from_target(target, draft_size, LAYERS, fingerprint="test")
    weights = (target.model.lm_head.weight.detach(), target.model.get_input_embeddings().weight.detach(), d2t, t2d)
    return target, extract(target, count, seed), weights, config


def run(cfg: TrainConfig, data, weights, config, out, **kwargs):
    return train(cfg, data, *weights, config, out, **kwargs)


def curve(out_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in NONDETERMINISTIC} for r in read_metrics(out_dir)]


@pytest.mark.parametrize(
    ("temperature", "reached_only", "feature_weight"), [(1.0, False, 0.0), (0.5, False, 0.0), (1.0, True, 0.5)]
)
def test_ttt_loss_matches_a_direct_computation(temperature, reached_only, feature_weight):
    """Position by position: step k at t is scored against the target's distribution at t+1+k restricted to the
    draft vocabulary and renormalised (at `label_temperature`), when token t+2+k exists and is in the loss mask (here
    in a padded batch). Top-1 is scored against the target's own argmax whatever the temperature. With
    `reached_only` the loss keeps step k at t only where every earlier step at t was scored and right (`chain_k`
    counts those positions whose step k is right too); the logged per-step KL and top-1 still cover every position.
    `feature_weight` adds the squared error of the drafter's normed state against the target's at t+1+k, relative
    to the latter's squared norm, to the optimised loss only."""
    _, data, (head, embed, d2t, t2d), config = setup(count=2, draft_size=64)
    model = Eagle3Model.from_weights(config, embed, head, d2t, t2d)
    batch = trainer_module.collate(data, 64, torch.device("cpu"))
    steps, weight = 3, 0.8
    loss, stats = ttt_loss(
        model, batch, head, steps, weight, torch.ones(steps), label_temperature=temperature,
        reached_only=reached_only, feature_weight=feature_weight,
    )  # fmt: skip
    draft_ids = torch.arange(64) + d2t
    with torch.no_grad():
        states = [model.draft_state(h) for h in ttt_forward(model, batch["input_ids"], batch["aux_hidden"], steps)]
        logits = [model.lm_head(state) for state in states]
    expected, masked_out = 0.0, 0
    right_run: dict[tuple[int, int], int] = {}  # position -> how many steps from step 0 on were scored and right
    for k in range(steps):
        kl, scored, correct, correct_draft, count, chain = 0.0, 0.0, 0, 0, 0, 0
        for b, sample in enumerate(data):
            length = len(sample["input_ids"])
            for t in range(length - 2 - k):
                if sample["loss_mask"][t + 2 + k]:
                    full = sample["last_hidden"][t + 1 + k] @ head.T
                    p = torch.softmax(full[draft_ids] / temperature, -1)
                    q = torch.softmax(logits[k][b, t], -1)
                    position_kl = float((p * (p.log() - q.log())).sum())
                    kl += position_kl
                    goal = sample["last_hidden"][t + 1 + k]
                    error = float((states[k][b, t] - goal).square().sum() / goal.square().sum())
                    reached = right_run.get((b, t), 0) == k
                    if reached or not reached_only:
                        scored += position_kl + feature_weight * error
                    else:
                        masked_out += 1
                    right = bool(draft_ids[q.argmax()] == full.argmax())
                    if reached and right:
                        right_run[b, t] = k + 1
                        chain += 1
                    correct += right
                    correct_draft += int(q.argmax() == p.argmax())  # speculators' metric: within the draft vocabulary
                    count += 1
        got = int(stats.count[k]), int(stats.correct[k]), int(stats.correct_draft[k]), int(stats.chain[k])
        assert got == (count, correct, correct_draft, chain)
        assert float(stats.loss_sum[k]) == pytest.approx(kl, rel=1e-4)
        expected += weight**k * scored
    later = int(stats.count[1:].sum())  # masking keeps some later positions and drops others: both paths are checked
    assert 0 < masked_out < later if reached_only else masked_out == 0
    assert loss.item() == pytest.approx(expected, rel=1e-4)


def test_loss_decreases_on_a_tiny_overfit_set(tmp_path):
    _, data, weights, config = setup(count=4)
    cfg = TrainConfig(max_steps=60, batch_size=2, lr=1e-2, warmup_steps=2, grad_clip=1.0, ttt_steps=3, val_fraction=0)
    result = run(cfg, data, weights, config, tmp_path)
    train_log = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    first, last = train_log[0], train_log[-1]
    assert last["loss"] < 0.25 * first["loss"]
    assert all(last[f"loss_{k}"] < 0.5 * first[f"loss_{k}"] for k in range(3))
    assert all(last[f"acc_{k}"] > first[f"acc_{k}"] + 0.2 for k in range(3))
    assert result.steps == 60 and result.val is None


def test_a_recorded_argmax_spares_the_full_head_and_gives_the_same_metrics(tmp_path, monkeypatch):
    """Samples whose store holds the target's argmax (recorded by the data stage) train without the full-vocabulary
    head and log what computing it logs; a sample missing one where it is needed (-1) is computed."""
    _, data, weights, config = setup(count=6)
    cfg = TrainConfig(max_steps=4, batch_size=2, ttt_steps=2, eval_every=2, val_fraction=0.34)
    run(cfg, data, weights, config, tmp_path / "computed")
    head = weights[0]
    recorded = [s | {"target_top": trainer_module.target_top(s["last_hidden"], head)} for s in data]
    recorded[0]["target_top"][:-1][recorded[0]["loss_mask"][1:].bool()] = -1  # not recorded where needed
    computed, real = [], trainer_module.target_top
    monkeypatch.setattr(trainer_module, "target_top", lambda *args: computed.append(1) or real(*args))
    run(cfg, recorded, weights, config, tmp_path / "recorded")
    assert len(computed) == 1  # sample 0 only, once
    assert curve(tmp_path / "recorded") == curve(tmp_path / "computed")


def test_files_written_and_checkpoint_loads(tmp_path):
    target, data, weights, config = setup(count=8)
    cfg = TrainConfig(max_steps=5, batch_size=2, ttt_steps=2, checkpoint_every=2, eval_every=2, val_fraction=0.25)
    result = run(cfg, data, weights, config, tmp_path)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in records if r["split"] == "val"] == [2, 4, 5]
    expected = {"loss", "loss_0", "loss_1", "acc_0", "acc_1", "acc_draft_0", "acc_draft_1", "lr", "grad_norm"}
    assert expected | {"tokens_per_s"} <= records[0].keys()
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # checkpoints at 2, 4 and the end (5); the two newest are kept, and the best validation's; `latest` names the
    # last one, `best` the one with the highest validation chain length (its teacher-forced tau_fixed), which
    # evaluation and export use
    val = [r for r in records if r["split"] == "val"]
    assert all(r["chain_length"] == pytest.approx(1 + r["chain_0"] + r["chain_1"]) for r in val)
    assert all(r["chain_1"] <= r["chain_0"] <= r["acc_0"] for r in val)  # a chain is right at every step or not
    best = max(val, key=lambda r: r["chain_length"])["step"]  # the first of equals
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted(
        {f"step-{best:06d}", "step-000004", "step-000005"}
    )
    assert (tmp_path / "latest").read_text().strip() == "checkpoints/step-000005"
    assert (tmp_path / "best").read_text().strip() == f"checkpoints/step-{best:06d}"
    assert checkpoint_dir(tmp_path) == tmp_path / "checkpoints" / f"step-{best:06d}"
    assert result.checkpoint == tmp_path / "checkpoints" / "step-000005" and result.val["positions"] > 0
    assert {p.name for p in result.checkpoint.iterdir()} == {"model.safetensors", "config.json", "trainer_state.pt"}
    assert json.loads((result.checkpoint / "config.json").read_text())["draft_vocab_size"] == 64
    drafter = load_drafter(tmp_path, target)
    assert drafter.aux_layer_ids == LAYERS


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_retraces_an_uninterrupted_run(tmp_path, monkeypatch, optimizer):
    _, data, weights, config = setup(count=8)
    cfg = TrainConfig(max_steps=8, batch_size=2, lr=3e-3, warmup_steps=2, ttt_steps=3, checkpoint_every=3, eval_every=2,
                      optimizer=optimizer)  # fmt: skip
    run(cfg, data, weights, config, tmp_path / "whole")

    # Crash in the middle of step 6: step 5 was logged but the last checkpoint is step 3.
    real_step, calls = trainer_module.Trainer.train_step, []

    def crashing_step(self):
        calls.append(self.step)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, data, weights, config, tmp_path / "resumed")
    assert max(r["step"] for r in read_metrics(tmp_path / "resumed")) == 5
    monkeypatch.setattr(trainer_module.Trainer, "train_step", real_step)
    run(cfg, data, weights, config, tmp_path / "resumed")

    assert curve(tmp_path / "resumed") == curve(tmp_path / "whole")
    whole = load_drafter(tmp_path / "whole", tiny_target(0)).model.state_dict()
    resumed = load_drafter(tmp_path / "resumed", tiny_target(0)).model.state_dict()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_time_budget_ends_the_run_where_the_time_runs_out_with_its_schedule_finished(tmp_path, monkeypatch):
    """Every step "takes" 0.25 s of a fake clock: 3 s fit 12 of the 40 planned steps, the cosine schedule is
    re-planned to end there, and a resume with 6 s trains on to the 24 steps that fit in all."""
    _, data, weights, config = setup(count=8)
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    real_step = trainer_module.Trainer.train_step

    def timed_step(self):
        clock.now += 0.25
        return real_step(self)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", timed_step)
    cfg = TrainConfig(max_steps=40, max_minutes=0.05, batch_size=2, lr=1e-3, warmup_steps=2, ttt_steps=2,
                      val_fraction=0, checkpoint_every=100)  # fmt: skip
    assert run(cfg, data, weights, config, tmp_path).steps == 12
    lrs = [r["lr"] for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert len(lrs) == 12 and lrs[-1] < 0.05 * max(lrs)
    assert run(cfg.model_copy(update={"max_minutes": 0.1}), data, weights, config, tmp_path).steps == 24


def test_resume_refuses_a_different_config(tmp_path):
    _, data, weights, config = setup(count=4)
    run(TrainConfig(max_steps=1, batch_size=2, ttt_steps=2, val_fraction=0), data, weights, config, tmp_path)
    with pytest.raises(ConfigError, match="lr"):
        run(
            TrainConfig(max_steps=2, batch_size=2, ttt_steps=2, val_fraction=0, lr=1.0), data, weights, config, tmp_path
        )


def test_a_bad_value_of_a_union_typed_setting_names_the_setting_and_every_accepted_form():
    with pytest.raises(ConfigError) as err:
        TrainConfig.checked(bf16="maybe")
    assert str(err.value).startswith("invalid bf16='maybe': ") and "'auto'" in str(err.value)
    assert "bf16.bool" not in str(err.value) and "--bf16)" in err.value.hint
    with pytest.raises(ConfigError, match=r"invalid lr='fast': Input should be a valid number"):
        TrainConfig.checked(lr="fast")


def test_bad_inputs_fail_before_training(tmp_path):
    _, data, weights, config = setup(count=4)
    with pytest.raises(ConfigError, match="not a multiple"):
        run(TrainConfig(batch_size=3, micro_batch_size=2), data, weights, config, tmp_path)
    narrow = [s | {"aux_hidden": s["aux_hidden"][:, :64]} for s in data]
    with pytest.raises(DataError, match="aux_hidden has width 64"):
        run(TrainConfig(), narrow, weights, config, tmp_path)
    with pytest.raises(DataError, match="empty"):
        run(TrainConfig(), [], weights, config, tmp_path)


def _ddp_worker(rank: int, port: int, cfg, data, weights, config, out) -> None:
    import os

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank)
    )
    run(cfg, data, weights, config, out)


def test_two_processes_give_the_same_losses_as_one(tmp_path):
    """DDP (gloo, 2 processes, 2 sequences each) against 1 process (4 sequences) at a global batch of 4.

    Tolerance: relative 1e-5 on every logged loss and accuracy, over 3 steps. Only the order of the fp32 gradient
    sums differs (rank-local sums, then all-reduce), which moved them by at most 1e-7 relative when measured.
    """
    _, data, weights, config = setup(count=10)
    cfg = TrainConfig(max_steps=3, batch_size=4, lr=3e-3, warmup_steps=1, ttt_steps=3, eval_every=3, val_fraction=0.2)
    run(cfg, data, weights, config, tmp_path / "one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork, not spawn: the children inherit the imported modules (spawn spends ~10 s re-importing transformers).
    args = (port, cfg, data, weights, config, tmp_path / "two")
    mp.start_processes(_ddp_worker, args=args, nprocs=2, join=True, start_method="fork")
    one, two = curve(tmp_path / "one"), curve(tmp_path / "two")
    assert [(r["step"], r["split"]) for r in two] == [(r["step"], r["split"]) for r in one]  # rank 0 alone writes
    for a, b in zip(one, two, strict=True):
        for key, value in a.items():
            if key != "split":
                assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (a["step"], a["split"], key)


def test_recipe_switches(tmp_path):
    """The head is frozen by default (the target's rows stay), trained on request; all_positions trains on prompt
    tokens too; feature noise changes training, deterministically, and never validation."""
    _, data, weights, config = setup(count=8)
    for sample in data:  # a prompt half that is out of the loss
        sample["loss_mask"][: len(sample["loss_mask"]) // 2] = False
    base = dict(max_steps=3, batch_size=2, lr=1e-2, warmup_steps=1, ttt_steps=2, eval_every=3, val_fraction=0.25)
    runs = {
        name: run(TrainConfig(**base, **extra), data, weights, config, tmp_path / name)
        for name, extra in {
            "frozen": {},
            "head": {"freeze_lm_head": False},
            "all": {"all_positions": True},
            "noise": {"feature_noise": 0.5},
            "noise2": {"feature_noise": 0.5},
            "muon": {"optimizer": "muon"},
        }.items()
    }
    initial = Eagle3Model.from_weights(config, weights[1], weights[0], weights[2], weights[3]).lm_head.weight
    head = {name: load_drafter(tmp_path / name, setup()[0]).model.lm_head.weight for name in ("frozen", "head")}
    assert torch.equal(head["frozen"], initial) and not torch.allclose(head["head"], initial)
    assert runs["all"].train["positions"] > 1.5 * runs["frozen"].train["positions"]
    assert runs["all"].val["positions"] == runs["frozen"].val["positions"]  # validation scores the same tokens
    assert runs["noise"].train["loss"] != runs["frozen"].train["loss"]
    assert runs["noise"].train["loss"] == runs["noise2"].train["loss"]
    assert runs["muon"].train["loss"] != runs["frozen"].train["loss"]


def test_resume_with_a_store_of_other_layers_is_refused_in_one_line(tmp_path):
    target, data, weights, config = setup(count=4)
    cfg = TrainConfig(max_steps=2, batch_size=2, ttt_steps=2, val_fraction=0)
    run(cfg, data, weights, config, tmp_path)
    other = Eagle3Config.from_target(target, 64, (1, 2, 3), fingerprint="test")
    with pytest.raises(ConfigError) as err:
        run(cfg.model_copy(update={"max_steps": 4}), data, weights, other, tmp_path)
    first_line = str(err.value).splitlines()[0]
    assert "drafter aux_layer_ids=(0, 2, 3)" in first_line and "aux_layer_ids=(1, 2, 3)" in first_line


def test_bf16_training_follows_float32_and_micro_batches_change_nothing(tmp_path):
    """The CPU profiles train in bf16, four sequences a forward: the curve stays within bf16 rounding of float32's,
    the full-vocabulary top-1 (computed in bf16 there) counts the same positions, and micro-batching the same global
    batch gives float32's losses to float precision."""
    _, data, weights, config = setup(count=8)
    base = dict(max_steps=3, batch_size=4, lr=1e-2, warmup_steps=1, ttt_steps=2, eval_every=3, val_fraction=0.25)
    runs = {
        name: run(TrainConfig(**base, **extra), data, weights, config, tmp_path / name)
        for name, extra in {"fp32": {}, "bf16": {"bf16": True}, "micro": {"micro_batch_size": 4}}.items()
    }
    fp32, bf16, micro = (curve(tmp_path / name) for name in ("fp32", "bf16", "micro"))
    losses = [[r["loss"] for r in c if "loss" in r] for c in (fp32, bf16, micro)]
    assert losses[0] != losses[1] and losses[1] == pytest.approx(losses[0], rel=0.05)
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)
    assert runs["bf16"].val["positions"] == runs["fp32"].val["positions"]
    assert abs(runs["bf16"].val["acc_0"] - runs["fp32"].val["acc_0"]) <= 0.25


def test_a_compiled_ttt_forward_trains_as_the_eager_one(tmp_path):
    """`compile`: the TTT forward runs as a torch.compile graph (one for training, one for validation's no-grad
    forward, each over every batch shape) and the run's losses and metrics are eager's to float rounding."""
    from torch._dynamo.utils import counters

    _, data, weights, config = setup(count=8)
    base = dict(max_steps=3, batch_size=4, micro_batch_size=2, lr=1e-2, warmup_steps=1, ttt_steps=2, eval_every=3,
                val_fraction=0.25)  # fmt: skip
    counters.clear()
    run(TrainConfig(**base), data, weights, config, tmp_path / "eager")
    assert counters["stats"]["unique_graphs"] == 0
    run(TrainConfig(**base, compile=True), data, weights, config, tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] >= 2  # the training and the validation forward
    eager, compiled = curve(tmp_path / "eager"), curve(tmp_path / "compiled")
    assert [r["split"] for r in eager] == [r["split"] for r in compiled]
    for a, b in zip(eager, compiled, strict=True):
        numbers = {k: v for k, v in a.items() if isinstance(v, float)}
        assert numbers and {k: b[k] for k in numbers} == pytest.approx(numbers, rel=1e-4, abs=1e-6)
        assert {k: v for k, v in b.items() if k not in numbers} == {k: v for k, v in a.items() if k not in numbers}
    with pytest.raises(ValueError, match="compile applies to EAGLE-3"):
        TrainConfig(algo="dflash", compile=True)
    assert TrainConfig(algo="dflash", compile="auto").objective().steps == 15  # auto: DFlash trains eagerly


def test_the_pipeline_leaves_the_trainers_resume_state_out_of_the_train_fingerprint(tmp_path):
    """The train stage's fingerprint must skip exactly the file the trainer writes its resume state to."""
    from draftsmith.run_status import TRAINER_STATE, stage_fingerprint

    assert trainer_module.STATE_FILE == TRAINER_STATE
    _, data, weights, config = setup()
    run(TrainConfig(max_steps=1, batch_size=2, ttt_steps=2, val_fraction=0), data, weights, config, tmp_path)
    before = stage_fingerprint("train", tmp_path)
    state = next((tmp_path / "checkpoints").iterdir()) / TRAINER_STATE
    state.write_bytes(state.read_bytes() + b"\0")  # another wall time, the same drafter
    assert stage_fingerprint("train", tmp_path) == before
