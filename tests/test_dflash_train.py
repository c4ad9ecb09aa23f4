"""DFlash training: the block loss sees exactly what the drafter sees at inference; training learns; resume is exact."""

import pytest
import torch

from draftsmith.drafters.dflash import DFlashConfig, DFlashDrafter
from draftsmith.errors import ConfigError
from draftsmith.formats.load import load_drafter
from draftsmith.train import TrainConfig, train
from draftsmith.train import trainer as trainer_module
from draftsmith.train.losses import DFlashObjective, dflash_anchors, dflash_forward
from draftsmith.train.metrics import read_metrics
from tests.conftest import tiny_target
from tests.test_dflash import make_model, with_draft_vocab
from tests.test_train import LAYERS, curve, extract


def setup(count: int = 6, block_size: int = 4, seed: int = 0):
    target = tiny_target(seed)
    config = DFlashConfig.from_target(target, 2, LAYERS, block_size, fingerprint="test")
    weights = (target.model.lm_head.weight.detach(), target.model.get_input_embeddings().weight.detach(), None, None)
    return target, extract(target, count, seed), weights, config


def run(cfg: TrainConfig, data, weights, config, out):
    return train(cfg, data, *weights, config, out)


def test_block_training_forward_equals_inference():
    """Many blocks at once, under the training mask, give each block the logits the drafter computes for it alone
    after the target confirmed the tokens up to its anchor: no block sees another, or anything after its anchor."""
    target = tiny_target(1)
    model = make_model(target, block_size=5, ids=LAYERS).eval()
    sample = extract(target, 1, seed=3)[0]
    ids = sample["input_ids"].long()
    anchors = dflash_anchors(torch.ones(len(ids)), 6, torch.Generator().manual_seed(0))
    assert len(anchors) == 6 and anchors.min() >= 1 and anchors.max() < len(ids) - 1
    with torch.no_grad():
        hidden = dflash_forward(model, ids, sample["aux_hidden"], anchors)
        trained = model.lm_head(hidden[:, 1:])
    drafter = DFlashDrafter(model)
    for i, a in enumerate(anchors.tolist()):
        drafter.begin(ids[:a], sample["aux_hidden"][:a])
        torch.testing.assert_close(trained[i], drafter.block_logits(ids[: a + 1], 4), atol=1e-5, rtol=1e-5)


def test_draft_loss_is_cross_entropy_over_what_the_engine_drafts_from():
    """With `draft_loss` a block position's loss is the cross entropy of the logits the drafter's engine scores (the
    draft vocabulary's head rows) at the target-written token; a token outside the draft vocabulary adds no loss
    and counts as a miss; the accuracy compares target ids, not rows. `chain` counts the block positions whose
    drafts from position 1 on all equal the target's argmax."""
    target = tiny_target(2, vocab_size=12)
    model = with_draft_vocab(make_model(target, block_size=4, ids=LAYERS), target, 6).eval()
    sample = extract(target, 1, seed=4)[0]
    ids = sample["input_ids"].long()
    batch = {k: v[None] for k, v in sample.items()} | {"index": torch.tensor([0])}
    batch |= {"loss_mask": torch.ones_like(ids)[None], "target_top": ids[None].roll(-1, 1)}
    objective = DFlashObjective(4, None, anchors=5, kl=False, draft_loss=True)
    batch = objective.prepare(batch, 0)
    ones = torch.ones(3)
    with torch.no_grad():
        loss, stats = objective(model, batch, target.model.lm_head.weight.detach(), ones)
    drafter, row = DFlashDrafter(model), {int(t): i for i, t in enumerate(model.draft_ids)}
    weight, expected, hits, guesses = objective.step_weight, 0.0, torch.zeros(3), {}
    for a in batch["anchors"][0].tolist():
        drafter.begin(ids[:a], sample["aux_hidden"][:a])
        with torch.no_grad():
            logits = drafter.head(drafter._block(ids[: a + 1], 3)).float()
        guesses[a] = model.draft_ids[logits.argmax(-1)]
        for k in range(3):
            if a + k + 1 >= len(ids):
                continue
            label = int(ids[a + k + 1])
            if label in row:
                expected += weight**k * float(torch.nn.functional.cross_entropy(logits[k], torch.tensor(row[label])))
            hits[k] += int(model.draft_ids[logits[k].argmax()]) == label
    assert float(loss) == pytest.approx(expected, rel=1e-4)
    assert stats.correct_draft.float().tolist() == hits.tolist()
    assert stats.count.sum() > 0 and any(int(t) not in row for t in ids[1:])  # the out-of-vocabulary case ran

    # The target's argmax (which the loss does not read) right at the first anchor's block positions 1 and 2, and at
    # the second anchor's position 2 only: whole chains of 1 and 2, and a right draft after a wrong one.
    first, second = list(guesses)[:2]
    top = batch["target_top"].clone()
    for a, right_at in ((first, (0, 1)), (second, (1,))):
        for k in range(3):
            if a + k + 1 < len(ids):
                top[0, a + k] = guesses[a][k] if k in right_at else (guesses[a][k] + 1) % target.vocab_size
    with torch.no_grad():
        stats = objective(model, batch | {"target_top": top}, target.model.lm_head.weight.detach(), ones)[1]
    chains = torch.zeros(3)
    for a, drafted in guesses.items():
        whole = True
        for k in range(3):
            whole = whole and a + k + 1 < len(ids) and bool(drafted[k] == top[0, a + k])
            chains[k] += whole
    assert stats.chain.float().tolist() == chains.tolist() and chains[1] >= 1 and stats.correct[1] > stats.chain[1]


def test_draft_loss_needs_a_draft_vocabulary():
    with pytest.raises(ConfigError, match="draft vocabulary"):
        TrainConfig.checked(algo="dflash", draft_loss=True)
    with pytest.raises(ConfigError, match="draft vocabulary"):
        TrainConfig.checked(algo="eagle3", draft_loss=True, draft_vocab=True)
    assert TrainConfig.checked(algo="dflash", draft_loss=True, draft_vocab=True).objective().draft_loss


def test_anchors_stay_inside_the_loss_mask():
    mask = torch.zeros(30, dtype=torch.bool)
    mask[10:20] = True
    anchors = dflash_anchors(mask, 100)
    assert anchors.tolist() == list(range(10, 20))


def test_loss_decreases_and_weights_decay(tmp_path):
    _, data, weights, config = setup(count=4)
    cfg = TrainConfig(algo="dflash", block_size=4, max_steps=40, batch_size=2, lr=1e-2, warmup_steps=2, grad_clip=1.0,
                      val_fraction=0, anchors=8)  # fmt: skip
    result = run(cfg, data, weights, config, tmp_path)
    log = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"] and {"loss_2", "acc_2"} <= log[0].keys()
    weight = cfg.objective().step_weight  # exp(-1/gamma): gamma 4 for blocks of 8 (and scaled for 4)
    assert log[0]["loss"] == pytest.approx(sum(weight**k * log[0][f"loss_{k}"] for k in range(3)), rel=1e-5)
    drafter = load_drafter(tmp_path, tiny_target(0))
    assert isinstance(drafter, DFlashDrafter) and drafter.block_size == 4 and result.steps == 40


def test_gamma_defaults():
    assert TrainConfig(algo="dflash", block_size=16).objective().step_weight == pytest.approx(torch.e ** (-1 / 7))
    assert TrainConfig(algo="dflash", block_size=8).objective().step_weight == pytest.approx(torch.e ** (-1 / 4))


@pytest.mark.parametrize("kl", [False, True])
def test_resume_retraces_an_uninterrupted_run(tmp_path, monkeypatch, kl):
    _, data, weights, config = setup(count=8)
    cfg = TrainConfig(algo="dflash", block_size=4, max_steps=6, batch_size=2, lr=3e-3, warmup_steps=2,
                      checkpoint_every=2, eval_every=2, anchors=4, kl=kl)  # fmt: skip
    run(cfg, data, weights, config, tmp_path / "whole")
    real_step, calls = trainer_module.Trainer.train_step, []

    def crashing_step(self):
        calls.append(self.step)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, data, weights, config, tmp_path / "resumed")
    monkeypatch.setattr(trainer_module.Trainer, "train_step", real_step)
    run(cfg, data, weights, config, tmp_path / "resumed")
    assert curve(tmp_path / "resumed") == curve(tmp_path / "whole")
    whole = load_drafter(tmp_path / "whole", tiny_target(0)).model.state_dict()
    resumed = load_drafter(tmp_path / "resumed", tiny_target(0)).model.state_dict()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_resume_refuses_another_block_size(tmp_path):
    _, data, weights, config = setup(count=4)
    run(TrainConfig(algo="dflash", block_size=4, max_steps=1, batch_size=2, val_fraction=0), data, weights, config,
        tmp_path)  # fmt: skip
    with pytest.raises(ConfigError, match="block_size"):
        cfg = TrainConfig(algo="dflash", block_size=8, max_steps=2, batch_size=2, val_fraction=0)
        run(cfg, data, weights, setup(count=4, block_size=8)[3], tmp_path)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_give_the_same_losses_as_one(tmp_path, fsdp):
    """DDP, or FSDP (the drafter sharded as one unit), on 2 gloo processes against 1 process at the same global
    batch: the anchors are seeded by step and sequence, not by the process, so both draw the same blocks (tolerance
    as EAGLE-3's); the checkpoint holds the full weights a one-process run writes, within 1e-5 (Adam's normalised
    steps turn the fp32 sums' other order into up to 1.7e-6 where a gradient is near 0; weights of size 0.1 to 1)."""
    from safetensors.torch import load_file

    from tests.test_distributed import assert_same_curves, launch

    _, data, weights, config = setup(count=10)
    cfg = TrainConfig(algo="dflash", block_size=4, max_steps=3, batch_size=4, lr=3e-3, warmup_steps=1, anchors=4,
                      eval_every=3, val_fraction=0.2, checkpoint_every=3, fsdp=fsdp)  # fmt: skip
    launch(1, cfg, data, weights, config, tmp_path / "one")
    launch(2, cfg, data, weights, config, tmp_path / "two")
    assert_same_curves(curve(tmp_path / "one"), curve(tmp_path / "two"))
    one = load_file(tmp_path / "one/checkpoints/step-000003/model.safetensors")
    two = load_file(tmp_path / "two/checkpoints/step-000003/model.safetensors")
    assert one.keys() == two.keys() and all(torch.allclose(one[k], two[k], rtol=0, atol=1e-5) for k in one)
