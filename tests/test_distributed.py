"""Distributed training on CPU (gloo, 2 processes): FSDP gives the losses of one process, and a checkpoint written
by one world size resumes on another (FSDP on 2 -> 1 process, 1 process -> DDP on 2) as if never interrupted."""

import contextlib
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from draftsmith.train import TrainConfig
from draftsmith.train import trainer as trainer_module
from draftsmith.train.metrics import read_metrics
from tests.test_train import curve, run, setup


class Stop(Exception):
    """Raised by every rank at the same step: a crash right after a checkpoint, with no collective left waiting."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg, data, weights, config, out, stop_at) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    if stop_at is not None:
        real_step = trainer_module.Trainer.train_step

        def step_or_stop(self):
            if self.step == stop_at:
                raise Stop
            return real_step(self)

        trainer_module.Trainer.train_step = step_or_stop
    with contextlib.suppress(Stop):
        run(cfg, data, weights, config, out)


def launch(world: int, cfg, data, weights, config, out, stop_at=None) -> None:
    """`world` processes (forked: they inherit the imported modules), as torchrun would start them."""
    if world == 1:
        _single(cfg, data, weights, config, out, stop_at)
        return
    args = (world, _free_port(), cfg, data, weights, config, out, stop_at)
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="fork")


def _single(cfg, data, weights, config, out, stop_at) -> None:
    """One plain process (no process group), stopped like the workers."""
    real_step = trainer_module.Trainer.train_step

    def step_or_stop(self):
        if self.step == stop_at:
            raise Stop
        return real_step(self)

    trainer_module.Trainer.train_step = step_or_stop
    try:
        run(cfg, data, weights, config, out)
    except Stop:
        pass
    finally:
        trainer_module.Trainer.train_step = real_step


def assert_same_curves(a: list[dict], b: list[dict]) -> None:
    """Relative 1e-5 on every logged loss, accuracy, lr and gradient norm: sharding or splitting the batch only
    reorders fp32 sums (measured differences were below 1e-6 relative)."""
    assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
    for x, y in zip(a, b, strict=True):
        for key, value in x.items():
            if key != "split":
                assert y[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (x["step"], x["split"], key)


CFG = dict(batch_size=4, lr=3e-3, warmup_steps=1, ttt_steps=3, eval_every=2, val_fraction=0.3, checkpoint_every=2)


def test_fsdp_on_two_processes_gives_the_losses_of_one(tmp_path):
    """FSDP: parameters, gradients and optimiser states sharded over 2 gloo processes, 2 sequences each; the
    validation set (3 sequences) splits unevenly, so one rank runs a discarded filler forward."""
    _, data, weights, config = setup(count=10)
    cfg = TrainConfig(max_steps=3, **CFG)
    launch(1, cfg, data, weights, config, tmp_path / "one")
    launch(2, cfg.model_copy(update={"fsdp": True}), data, weights, config, tmp_path / "fsdp")
    assert_same_curves(curve(tmp_path / "one"), curve(tmp_path / "fsdp"))
    one = torch.load(tmp_path / "one/checkpoints/step-000003/trainer_state.pt", weights_only=True)["optimizer"]
    two = torch.load(tmp_path / "fsdp/checkpoints/step-000003/trainer_state.pt", weights_only=True)["optimizer"]
    assert one["state"].keys() == two["state"].keys()  # the same full, positional layout as one process writes
    for i, state in one["state"].items():
        assert torch.allclose(state["exp_avg"], two["state"][i]["exp_avg"], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(
    ("first", "then"),
    [((2, True), (1, False)), ((1, False), (2, False))],
    ids=["fsdp-2-then-1-process", "1-process-then-ddp-2"],
)
def test_a_checkpoint_resumes_with_another_number_of_processes(tmp_path, first, then):
    """Train to step 4 of 6 on one world size (checkpoint at 4), resume to 6 on the other: the loss curve and the
    final weights match an uninterrupted one-process run: curves within 1e-5 relative, weights (of size 0.1 to 1)
    within 1e-6 absolute; measured: at most 2e-7, from the fp32 sums in another order."""
    _, data, weights, config = setup(count=10)
    cfg = TrainConfig(max_steps=6, **CFG)
    launch(1, cfg, data, weights, config, tmp_path / "whole")
    (world, fsdp), (world_then, fsdp_then) = first, then
    out = tmp_path / "resumed"
    launch(world, cfg.model_copy(update={"fsdp": fsdp}), data, weights, config, out, stop_at=4)
    assert (out / "latest").read_text().strip() == "checkpoints/step-000004"
    assert max(r["step"] for r in read_metrics(out)) == 4
    launch(world_then, cfg.model_copy(update={"fsdp": fsdp_then}), data, weights, config, out)
    assert_same_curves(curve(tmp_path / "whole"), curve(out))
    from safetensors.torch import load_file

    a = load_file(tmp_path / "whole/checkpoints/step-000006/model.safetensors")
    b = load_file(out / "checkpoints/step-000006/model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
