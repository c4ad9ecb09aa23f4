"""The training loop for EAGLE-3 (TTT loss) and DFlash (block loss): AdamW with warm-up + cosine, clipping,
checkpoints, exact resume, DDP/FSDP (FSDP for EAGLE-3 only).

Determinism is by construction, so a resumed run retraces an uninterrupted one: step s always trains on the same
global batch (an endless stream of seeded per-epoch permutations, so the data position is the step number), the
model starts from a seeded init, and a checkpoint holds the model, optimiser, scheduler and RNG states.

Data parallelism: under torchrun (WORLD_SIZE > 1) every rank takes every world-th sequence of the global batch and
the gradients are summed across ranks. Each micro-batch loss is already divided by the global batch's count of
valid positions per TTT step, so the sum is the exact token-level mean whatever the world size or micro-batching.
With `fsdp` the drafter is sharded over the ranks instead of replicated (see train/distributed.py). Only rank 0
writes files, and a checkpoint always holds full tensors: a run resumes with any number of processes, DDP or FSDP.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file
from torch.utils.data import Dataset

from draftsmith.config import StageConfig
from draftsmith.drafters import dflash, eagle3
from draftsmith.drafters.dflash import DFlashConfig, DFlashModel
from draftsmith.drafters.eagle3 import CONFIG_FILE, WEIGHTS_FILE, Eagle3Config, Eagle3Model
from draftsmith.errors import ConfigError, DataError
from draftsmith.progress import progress_bar
from draftsmith.target import AUTO, bf16_is_native
from draftsmith.train.losses import DFlashObjective, TTTObjective, target_top
from draftsmith.train.metrics import MetricsWriter, StepStats, plot_curves, read_metrics
from draftsmith.train.optim import build_optimizer
from draftsmith.util import crash_point, fsync_tree, replace_durable, swap_dirs, sweep_temp, temp_path, write_atomic

STATE_FILE = "trainer_state.pt"  # the resume state beside a checkpoint's weights (run_status.TRAINER_STATE)
# Settings a resumed run may change; any other difference would silently change the run, so it is an error.
RESUMABLE = {"max_steps", "max_minutes", "epochs", "checkpoint_every", "keep_checkpoints", "eval_every", "fsdp"}
PLAN_AFTER = 5  # steps timed before a time budget re-plans the run's length


class TrainConfig(StageConfig):
    algo: Literal["eagle3", "dflash"] = "eagle3"
    max_steps: int | None = Field(default=None, ge=1)  # overrides epochs
    # ... or as many steps as fit in this time (validation and checkpoints included): the run is re-planned from
    # the measured time per step, so the cosine schedule still ends at its last step; at most max_steps / epochs
    max_minutes: float | None = Field(default=None, gt=0)
    epochs: float = Field(default=1.0, gt=0)
    batch_size: int = Field(default=8, ge=1)  # sequences per optimiser step, over all ranks
    micro_batch_size: int = Field(default=1, ge=1)  # sequences per forward on one rank, padded to the longest
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=20, ge=0)
    grad_clip: float = Field(default=0.5, gt=0)
    ttt_steps: int = Field(default=7, ge=1)
    step_weight: float = Field(default=0.8, gt=0)
    # EAGLE-3: the TTT loss's target distribution at this temperature; < 1 sharpens it towards the target's argmax
    label_temperature: float = Field(default=1.0, gt=0)
    # EAGLE-3: step k's loss only where steps < k drafted the target's argmax (GRIFFIN's loss masking, ttt_loss)
    reached_only: bool = False
    # EAGLE-3: weight of EAGLE-1's feature regression (the drafter's normed state against the target's; ttt_loss)
    feature_weight: float = Field(default=0.0, ge=0)
    checkpoint_every: int = Field(default=200, ge=1)
    keep_checkpoints: int = Field(default=2, ge=1)
    eval_every: int = Field(default=100, ge=1)
    val_fraction: float = Field(default=0.05, ge=0, lt=1)
    seed: int = 0
    # bf16 autocast (CPU or CUDA); weights, optimiser and losses stay fp32. auto: only where bf16 is native (a GPU,
    # an AMX or AVX512-BF16 CPU); emulated bf16 on an AVX2 CPU is several times slower than float32
    bf16: bool | Literal["auto"] = False
    max_length: int = Field(default=2048, ge=3)  # longer sequences are truncated
    # torch.compile the EAGLE-3 drafter's TTT forward (`TTTObjective.compile`): ~1.35x the steps per second on a
    # 2-core CPU, after ~15 s of compiling. auto: EAGLE-3 without FSDP; DFlash trains eagerly
    compile: bool | Literal["auto"] = False
    fsdp: bool = False  # under torchrun: shard the drafter over the processes (FSDP2) instead of replicating it
    # The drafter's layer variant (speculators' switches; see drafters/eagle3.py): stages.train passes them to
    # Eagle3Config.from_target. All off is the original EAGLE-3 layer.
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    qk_norm: bool = False
    sliding_window: int | None = Field(default=None, ge=1)
    intermediate_size: int | None = Field(default=None, ge=1)  # the drafter's MLP width; None: the target's
    init: Literal["random", "logit_lens"] = "random"  # logit_lens: start as lm_head(norm(deepest aux state))
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon on the hidden matrices, AdamW on the rest
    freeze_lm_head: bool = True  # keep the target's head rows (as speculators does): fewer weights to overfit
    all_positions: bool = False  # train on every position (prompt tokens too): the label is the target's anyway
    feature_noise: float = Field(default=0.0, ge=0)  # N(0, (noise * rms(f))^2) added to the target features
    # DFlash (algo dflash): the drafter reads every layer of the store; see drafters/dflash.py and train/losses.py.
    block_size: int = Field(default=16, ge=2)
    draft_layers: int = Field(default=1, ge=1)  # the drafter's decoder layers (z-lab ships 5 at GPU scale)
    gamma: float | None = Field(default=None, gt=0)  # loss decay exp(-(k-1)/gamma); None: 7 for B=16, 4 for B=8
    anchors: int = Field(default=32, ge=1)  # blocks per sequence per step
    kl: bool = False  # KL to the target's distribution instead of cross entropy on the target-written token
    mask_token_id: int | None = Field(default=None, ge=0)  # None: the tokenizer's mask, else a spare special token
    draft_vocab: bool = False  # draftsmith's engine scores only the vocab stage's tokens (training: the full head)
    # ... and the training loss scores only them too (needs draft_vocab): the drafter learns the choice the engine
    # makes, at a fraction of the head's cost; engines that serve the full head see rows it was never trained against
    draft_loss: bool = False

    @model_validator(mode="after")
    def _draft_loss_needs_a_draft_vocabulary(self) -> TrainConfig:
        """A profile that asks for it fails when it loads, not after its data stage."""
        if self.draft_loss and not (self.algo == "dflash" and self.draft_vocab):
            raise ValueError("draft_loss scores a DFlash drafter's loss over its draft vocabulary; add draft_vocab")
        return self

    @model_validator(mode="after")
    def _eagle3_settings_are_for_eagle3(self) -> TrainConfig:
        if self.intermediate_size is not None and self.algo == "dflash":
            raise ValueError("intermediate_size sets the EAGLE-3 drafter's MLP width; DFlash takes the target's")
        if self.label_temperature != 1.0 and self.algo == "dflash":
            raise ValueError("label_temperature applies to EAGLE-3's TTT loss; DFlash's is set by kl")
        if self.reached_only and self.algo == "dflash":
            raise ValueError("reached_only applies to EAGLE-3's TTT loss; DFlash's block loss scores every position")
        if self.feature_weight and self.algo == "dflash":
            raise ValueError("feature_weight applies to EAGLE-3's TTT loss; DFlash's drafter has no such state")
        return self

    @model_validator(mode="after")
    def _compile_is_for_eagle3(self) -> TrainConfig:
        if self.compile is True and (self.algo == "dflash" or self.fsdp):
            raise ValueError("compile applies to EAGLE-3's TTT forward without fsdp; use compile: auto or false")
        return self

    def objective(self) -> TTTObjective | DFlashObjective:
        """What one step computes: EAGLE-3's training-time test, or DFlash's block loss."""
        if self.algo == "dflash":
            return DFlashObjective(self.block_size, self.gamma, self.anchors, self.kl, self.seed, self.draft_loss)
        objective = TTTObjective(
            self.ttt_steps, self.step_weight, self.label_temperature, self.reached_only, self.feature_weight
        )
        if self.compile is True or self.compile == AUTO and not self.fsdp:
            objective.compile()
        return objective

    def uses_bf16(self, device: torch.device | str) -> bool:
        """Does training on `device` autocast to bf16? `auto`: only where bf16 is native (`bf16_is_native`)."""
        return self.bf16 is True or self.bf16 == AUTO and bf16_is_native(device)


@dataclass
class TrainResult:
    checkpoint: Path
    steps: int
    train: dict[str, float]  # the last step's metrics
    val: dict[str, float] | None  # the last validation's metrics


def train(
    cfg: TrainConfig,
    dataset: Dataset,
    target_head: torch.Tensor,
    embed_weight: torch.Tensor,
    d2t: torch.Tensor | None,
    t2d: torch.Tensor | None,
    model_config: Eagle3Config | DFlashConfig,
    out_dir: str | Path,
    resume: bool = True,
    final_norm: torch.Tensor | None = None,
) -> TrainResult:
    """Train a drafter on `dataset` (dicts of input_ids, loss_mask, aux_hidden, last_hidden) into `out_dir`.

    `target_head` (V, H) is the target's frozen output head: with `last_hidden` it gives the target distribution.
    A `DFlashConfig` trains a DFlash drafter with the target's full head; with `draft_vocab_size` the checkpoint also
    keeps d2t's tokens as the draft vocabulary draftsmith's engine scores (t2d is unused).
    With `resume`, training continues from the newest whole checkpoint in `out_dir` when there is one; otherwise
    it starts over and deletes the directory's earlier checkpoints (its own `checkpoints/step-*` only).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        check_dataset(dataset, model_config)
        seed_everything(cfg.seed)
        if isinstance(model_config, DFlashConfig):
            model = DFlashModel(model_config).attach(embed_weight, target_head)
            if model_config.draft_vocab_size is not None and d2t is not None:
                model.draft_ids.copy_(torch.arange(len(d2t)) + d2t.long().cpu())
            return Trainer(cfg, dataset, model, target_head, Path(out_dir), device).run(resume)
        model = Eagle3Model.from_weights(model_config, embed_weight, target_head, d2t, t2d)
        model.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
        if cfg.init == "logit_lens":
            if final_norm is None:
                raise ConfigError("init logit_lens needs the target's final norm weight", hint="use init random")
            model.start_from_logit_lens(final_norm)
        return Trainer(cfg, dataset, model, target_head, Path(out_dir), device).run(resume)
    finally:
        if owns_group:
            dist.destroy_process_group()


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        dataset: Dataset,
        model: Eagle3Model | DFlashModel,
        target_head: torch.Tensor,
        out_dir: Path,
        device: torch.device,
    ) -> None:
        """`model` is freshly initialised (seeded); `target_head` is the frozen target head for the target logits."""
        self.cfg, self.dataset, self.out_dir, self.device = cfg, dataset, out_dir, device
        self.objective = cfg.objective()
        self.checkpoints = dflash if isinstance(model, DFlashModel) else eagle3  # save/read_config/FROZEN
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if cfg.batch_size % (cfg.micro_batch_size * self.world):
            raise ConfigError(
                f"batch_size {cfg.batch_size} is not a multiple of micro_batch_size {cfg.micro_batch_size} x "
                f"{self.world} processes",
                hint="pick a global batch size that splits evenly over processes and micro-batches",
            )
        self.train_idx, self.val_idx = split_indices(len(dataset), cfg.val_fraction, cfg.seed)
        self.planned_steps = cfg.max_steps or math.ceil(cfg.epochs * len(self.train_idx) / cfg.batch_size)
        self.total_steps = self.planned_steps  # fewer when `max_minutes` runs out first (`_fit_budget`)
        self.seconds = 0.0  # wall time spent on steps, validation and checkpoints, over resumes

        self.model = model.to(device)
        self.head = target_head.detach().to(device, torch.float32)
        self.bf16 = cfg.uses_bf16(device)
        self.top_head = self.head.to(torch.bfloat16) if self.bf16 else self.head  # feeds only the accuracy metric
        self.target_tops: dict[int, torch.Tensor] = {}  # sample index -> the target's argmax per position
        self.sharded = None  # with FSDP: the root module whose forward is the loss
        if cfg.fsdp and self.world > 1:
            from draftsmith.train.distributed import shard

            self.sharded = shard(self.model, self.head, self.objective)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if cfg.optimizer == "muon" and self.sharded is not None:
            raise ConfigError("optimizer muon is not supported with --fsdp yet", hint="use AdamW or DDP")
        self.optimizer = build_optimizer(self.model, cfg.optimizer, cfg.lr, cfg.weight_decay)
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, self.total_steps)
        )
        self.step = 0
        self.best_length = 0.0  # the best validation chain_length so far; its checkpoint is kept as `best`

    def run(self, resume: bool) -> TrainResult:
        cfg = self.cfg
        latest = self.out_dir / "latest"
        if self.rank == 0:  # what a killed run was writing was never renamed into place, so it is not whole
            sweep_temp(self.out_dir)
            sweep_temp(self.out_dir / "checkpoints")
        check_no_foreign_checkpoints(self.out_dir)
        newest = own_checkpoints(self.out_dir)[-1:] if resume else []
        if newest:  # the newest whole checkpoint, even if a crash came before `latest` pointed at it
            self.load(newest[0])
        elif self.rank == 0:  # starting over: an earlier run's checkpoints must not outlive (or outrank) ours
            for old in own_checkpoints(self.out_dir):
                shutil.rmtree(old)
            latest.unlink(missing_ok=True)
            (self.out_dir / "best").unlink(missing_ok=True)
        if self.world > 1 and self.sharded is None:  # every rank starts from rank 0's weights (FSDP: seeded alike)
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, 0)
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        writer = MetricsWriter(self.out_dir, self.step) if self.rank == 0 else None
        train_metrics: dict[str, float] = {}
        val_metrics: dict[str, float] | None = None
        columns = (
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        with progress_bar(*columns, disable=self.rank != 0) as progress:
            task = progress.add_task("train", total=self.total_steps, completed=self.step, info="")
            while self.step < self.total_steps:
                start = time.perf_counter()
                stats, tokens, grad_norm = self.train_step()
                seconds = time.perf_counter() - start
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                self.step += 1
                train_metrics = stats.summary(self.objective.step_weight)
                train_metrics.update(lr=lr, grad_norm=grad_norm, tokens_per_s=tokens / seconds)
                if writer:
                    writer.log(self.step, "train", train_metrics)
                if cfg.max_minutes is not None:
                    self._fit_budget(self.seconds + seconds)
                    progress.update(task, total=self.total_steps)
                done = self.step == self.total_steps
                best = False
                if self.val_idx and (self.step % cfg.eval_every == 0 or done):
                    val_metrics = self.validate().summary(self.objective.step_weight)
                    if writer:
                        writer.log(self.step, "val", val_metrics)
                    best = val_metrics["chain_length"] > self.best_length
                    self.best_length = max(self.best_length, val_metrics["chain_length"])
                self.seconds += time.perf_counter() - start
                if best or self.step % cfg.checkpoint_every == 0 or done:
                    start = time.perf_counter()
                    self.save(best)  # its state holds the seconds up to here; its own time counts from the next
                    self.seconds += time.perf_counter() - start
                m = train_metrics
                info = f"loss {m['loss']:.3f}  acc_0 {m['acc_0']:.2f}  {m['tokens_per_s']:,.0f} tok/s"
                progress.update(task, completed=self.step, info=info)
        last: dict[str, dict] = {}
        if writer:
            writer.close()
            last = {record["split"]: record for record in read_metrics(self.out_dir)}
            if last:
                plot_curves(self.out_dir)
        # A run that was already complete trains nothing: report what its log says.
        train_metrics = train_metrics or last.get("train", {})
        val_metrics = val_metrics or last.get("val")
        return TrainResult(self.checkpoint_dir(self.step), self.step, train_metrics, val_metrics)

    def _sample(self, index: int, train: bool) -> dict[str, torch.Tensor]:
        """A dataset item plus the target's full-vocabulary argmax per position. It only feeds the accuracy metric
        but costs 12x the draft-vocabulary distribution (49k vs 4k head rows for SmolLM2): ~20 % of an EAGLE-3 first
        epoch on a CPU even in bf16 (`top_head`). So it comes from the store where the data stage recorded it for
        every position whose next token is trained on, else it is computed once per sample and cached.
        With `all_positions` every token is in the training loss: the label is the target's distribution, which
        exists at prompt tokens too. Validation always scores the assistant tokens, so recipes compare."""
        sample = self.dataset[index]
        if self.cfg.all_positions and train:
            sample = sample | {"loss_mask": torch.ones_like(sample["loss_mask"])}
        recorded = sample.get("target_top")
        if recorded is not None and bool((recorded[:-1] >= 0)[sample["loss_mask"][1:].bool()].all()):
            return sample
        if index not in self.target_tops:
            self.target_tops[index] = target_top(sample["last_hidden"].to(self.device), self.top_head).cpu()
        return sample | {"target_top": self.target_tops[index]}

    def add_noise(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Training only: the drafter reads the target's features slightly perturbed, so it does not lean on detail
        that its own drafted states (steps >= 1) and other prompts do not have."""
        if not self.cfg.feature_noise:
            return batch
        aux = batch["aux_hidden"]
        rms = aux.float().pow(2).mean(-1, keepdim=True).sqrt()
        return batch | {"aux_hidden": aux + self.cfg.feature_noise * rms * torch.randn_like(aux, dtype=torch.float32)}

    def micro_batches(self, indices: list[int], train: bool = True) -> list[dict[str, torch.Tensor]]:
        mine = indices[self.rank :: self.world]
        size = self.cfg.micro_batch_size
        return [
            collate([self._sample(i, train) for i in mine[j : j + size]], self.cfg.max_length, self.device)
            | {"index": torch.tensor(mine[j : j + size])}  # which dataset sequences: DFlash seeds its anchors by them
            for j in range(0, len(mine), size)
        ]

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def train_step(self) -> tuple[StepStats, int, float]:
        """One optimiser step over the global batch; returns its stats, token count and gradient norm."""
        cfg = self.cfg
        batches = self.micro_batches(global_batch(self.train_idx, self.step, cfg.batch_size, cfg.seed))
        batches = [self.objective.prepare(batch, self.step) for batch in batches]
        counts = torch.zeros(1 + self.objective.steps, device=self.device)  # tokens, then valid positions per step
        for batch in batches:
            counts[0] += batch["loss_mask"].numel()
            counts[1:] += self.objective.valid(batch)
        if self.world > 1:
            dist.all_reduce(counts)
        stats = StepStats.zeros(self.objective.steps, self.device)
        for i, batch in enumerate(batches):
            if self.sharded is not None:  # FSDP: reduce-scatter the summed gradients once, after the last one
                self.sharded.set_requires_gradient_sync(i == len(batches) - 1)
            with self.autocast():
                loss, batch_stats = self.loss(self.add_noise(batch), counts[1:])
            loss.backward()
            stats += batch_stats
        if self.world > 1 and self.sharded is None:
            for p in self.params:
                dist.all_reduce(p.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats.all_reduce(), int(counts[0]), grad_norm

    @torch.no_grad()
    def validate(self) -> StepStats:
        stats = StepStats.zeros(self.objective.steps, self.device)
        ones = torch.ones(self.objective.steps, device=self.device)
        batches: list = [self.objective.prepare(b, -1) for b in self.micro_batches(self.val_idx, train=False)]
        if self.sharded is not None:  # FSDP: every rank runs as many forwards as the busiest one (collectives)
            most = torch.tensor(len(batches), device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            filler = self.micro_batches(self.val_idx[:1] * self.world, train=False)[0]  # results discarded
            batches += [None] * (int(most) - len(batches))
        for batch in batches:
            with self.autocast():
                batch_stats = self.loss(filler if batch is None else batch, ones)[1]
            if batch is not None:
                stats += batch_stats
        return stats.all_reduce()

    def loss(self, batch: dict[str, torch.Tensor], denominators: torch.Tensor) -> tuple[torch.Tensor, StepStats]:
        if self.sharded is not None:
            return self.sharded(batch, denominators)
        return self.objective(self.model, batch, self.head, denominators)

    def checkpoint_dir(self, step: int) -> Path:
        return self.out_dir / "checkpoints" / f"step-{step:06d}"

    def _fit_budget(self, spent: float) -> None:
        """Re-plan the run to the steps that fit in `max_minutes` at the wall time per step so far (`spent` seconds
        over `self.step` steps, validation and checkpoints included), never past the planned steps."""
        if self.step < PLAN_AFTER:
            return
        fits = int(60 * self.cfg.max_minutes * self.step / spent)
        self.total_steps = max(self.step, min(self.planned_steps, fits))
        if self.world > 1:  # every rank stops at rank 0's plan, or the others would wait on it forever
            plan = torch.tensor([self.total_steps], device=self.device)
            dist.broadcast(plan, 0)
            self.total_steps = int(plan)

    def save(self, best: bool = False) -> None:
        """Write the checkpoint under a temporary name, rename it into place, then point `latest` (and, when it
        has the best validation so far, `best`) at it. Rotation keeps the newest few and the best."""
        model, optimizer_state = self.model, None
        if self.sharded is not None:  # gather full tensors on every rank (collectives); rank 0 writes them
            from draftsmith.train import distributed

            model = type(self.model)(self.model.config)
            model.load_state_dict(distributed.full_model_state(self.model))
            optimizer_state = distributed.full_optimizer_state(self.optimizer)
        if self.rank == 0:
            final = self.checkpoint_dir(self.step)
            tmp = temp_path(final)
            shutil.rmtree(tmp, ignore_errors=True)
            self.checkpoints.save_checkpoint(model, tmp)
            state = {
                "step": self.step,
                "config": self.cfg.model_dump(mode="json"),
                "optimizer": optimizer_state or self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(),
                "best_chain_length": self.best_length,
                "seconds": self.seconds,
            }
            torch.save(state, tmp / STATE_FILE)
            fsync_tree(tmp)  # every byte on disk before the name says the checkpoint exists
            if final.exists():
                swap_dirs(tmp, final)  # an earlier checkpoint of this step (a resumed run redoing it)
                shutil.rmtree(tmp)
            else:
                replace_durable(tmp, final)
            crash_point("checkpoint-renamed")
            write_atomic(self.out_dir / "latest", f"checkpoints/{final.name}\n")
            if best:
                write_atomic(self.out_dir / "best", f"checkpoints/{final.name}\n")
            best_file = self.out_dir / "best"
            kept = best_file.read_text().strip() if best_file.is_file() else None
            for old in own_checkpoints(self.out_dir)[: -self.cfg.keep_checkpoints]:
                if f"checkpoints/{old.name}" != kept:
                    shutil.rmtree(old)
        if self.world > 1:
            dist.barrier()

    def load(self, path: Path) -> None:
        state = torch.load(path / STATE_FILE, map_location=self.device, weights_only=True)
        current = self.cfg.model_dump(mode="json")
        changed = {
            k: (v, current.get(k)) for k, v in state["config"].items() if k not in RESUMABLE and v != current.get(k)
        }
        saved_model, model = self.checkpoints.read_config(path).model_dump(), self.model.config.model_dump()
        changed |= {f"drafter {k}": (v, model.get(k)) for k, v in saved_model.items() if v != model.get(k)}
        if changed:
            field, (old, new) = next(iter(changed.items()))
            raise ConfigError(
                f"{self.out_dir} holds a run with {field}={old!r}, but this run has {field}={new!r}",
                hint="train into a new output directory, or start over without resuming",
            )
        weights = load_file(path / WEIGHTS_FILE, device=str(self.device))
        frozen = self.checkpoints.FROZEN
        if self.sharded is not None:  # scatter the full tensors into this run's shards
            from draftsmith.train import distributed

            distributed.load_model_state(self.model, weights | {k: self.model.state_dict()[k] for k in frozen})
            distributed.load_optimizer_state(self.optimizer, state["optimizer"])
        else:
            self.model.load_state_dict(weights | {k: self.model.state_dict()[k] for k in frozen})
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.best_length = float(state.get("best_chain_length", 0.0))  # 0 for a state from before chain_length
        self.seconds = float(state.get("seconds", 0.0))


def own_checkpoints(out_dir: Path) -> list[Path]:
    """The trainer's whole checkpoints in `out_dir/checkpoints`, oldest first: `step-NNNNNN` folders holding its
    state, weights and config. Anything else there is not ours, so it is never loaded or deleted."""
    folder = out_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if re.fullmatch(r"step-\d{6,}", p.name)
        and p.is_dir()
        and not p.is_symlink()
        and all((p / f).is_file() for f in (STATE_FILE, WEIGHTS_FILE, CONFIG_FILE))
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def check_no_foreign_checkpoints(out_dir: Path) -> None:
    """A `checkpoints/step-*` entry that is not one of ours would be overwritten by a save: refuse to start."""
    ours = set(own_checkpoints(out_dir))
    folder = out_dir / "checkpoints"
    foreign = sorted(p.name for p in folder.glob("step-*") if p not in ours) if folder.is_dir() else []
    if foreign:
        raise ConfigError(
            f"{folder} holds {', '.join(foreign[:3])}, which draftsmith did not write (no trainer state in it)",
            hint="move it away, or train into a new --out",
        )


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to zero at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded train/validation split; validation gets at least one sequence when asked for any."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = min(n - 1, max(1, round(n * val_fraction))) if val_fraction > 0 else 0
    return order[n_val:], order[:n_val]


@lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def global_batch(train_idx: list[int], step: int, batch_size: int, seed: int) -> list[int]:
    """The sequences of optimiser step `step`: positions step*B .. step*B+B-1 of an endless chain of epochs."""
    n = len(train_idx)
    return [train_idx[_epoch_order(n, seed, g // n)[g % n]] for g in range(step * batch_size, (step + 1) * batch_size)]


def collate(samples: list[dict[str, torch.Tensor]], max_length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence (pads are masked out of the loss; causal attention never sees them)."""
    length = min(max_length, max(len(s["input_ids"]) for s in samples))
    width_aux, width = samples[0]["aux_hidden"].shape[-1], samples[0]["last_hidden"].shape[-1]
    out = {
        "input_ids": torch.zeros(len(samples), length, dtype=torch.long),
        "loss_mask": torch.zeros(len(samples), length, dtype=torch.bool),
        "aux_hidden": torch.zeros(len(samples), length, width_aux),
        "last_hidden": torch.zeros(len(samples), length, width),
    }
    if "target_top" in samples[0]:
        out["target_top"] = torch.zeros(len(samples), length, dtype=torch.long)
    for i, sample in enumerate(samples):
        n = min(length, len(sample["input_ids"]))
        for key, value in out.items():
            value[i, :n] = sample[key][:n].to(value.dtype)
    return {key: value.to(device) for key, value in out.items()}


def check_dataset(dataset: Dataset, config: Eagle3Config | DFlashConfig) -> None:
    """Catch a store made for another target or layer count before any training starts."""
    if len(dataset) == 0:
        raise DataError("the training dataset is empty", hint="run `draftsmith extract` on some data first")
    sample = dataset[0]
    h = config.hidden_size
    widths = [
        ("aux_hidden", sample["aux_hidden"].shape[-1], len(config.aux_layer_ids) * h),
        ("last_hidden", sample["last_hidden"].shape[-1], h),
    ]
    for name, found, expected in widths:
        if found != expected:
            raise DataError(
                f"dataset {name} has width {found}, but the drafter for {config.target or 'this target'} expects "
                f"{expected}",
                hint="extract the hidden states with the same target and the drafter's aux layers",
            )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every RNG a step could touch, as plain tensors and tuples (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
