"""draftsmith's EAGLE-3 trainer against speculators 0.9.0's own trainer: same rows, same hidden states, same time.

Both trainers read the same tokenised rows and the same target hidden states (one `draftsmith extract` store,
converted once into the layout speculators' offline trainer reads), use the same draft vocabulary (d2t / t2d) and
the same training-time-test depth (= the chain length), and train for the same wall-clock budget on this machine.
Each checkpoint is then evaluated by `draftsmith eval` on the first `--prompts` MT-bench first turns, T=0, 128 new
tokens, with a fixed chain of `--chain` draft tokens. It prints one row per trainer and the ratio of tau_fixed
(tokens per target forward with the fixed chain), draftsmith / speculators.

    .venv/bin/python benchmarks/vs_speculators.py --store runs/abl/extract --vocab runs/abl/vocab \\
        [--minutes 10] [--chain 4] [--prompts 40] [--out runs/vs_speculators] [--threads 2]

Toy check (seconds of training): `--store /tmp/vs/extract --vocab /tmp/vs/vocab --minutes 0.5 --prompts 2`.

**speculators' side** runs `speculators.train.cli.main` (its `speculators train` entry point) with its default
config (`TrainConfig` defaults: eagle3, one llama layer, norm_before_fc / norm_before_residual / norm_output on,
Muon + AdamW at lr 1e-3, linear schedule with 1 % warm-up, KL loss, equal TTT step weights, bf16 autocast, 90/10
train/validation split, a checkpoint and a validation per epoch, `checkpoint_best`, seed 42) and only these
settings: `ttt_steps` = `--chain`; `target_layer_ids` = the store's layer ids; `d2t_path` / `t2d_path` = the draft
vocabulary; `max_steps` = the steps that fit the budget (and `epochs` enough to reach them); and what a CPU needs:
- `draft_attn_impl=sdpa`: FlexAttention, its default, "does not support backward on CPU";
- `loss_implementation=eager`: its fused losses "require Triton";
- `num_workers=0`: its default of 12 spawned loader processes on 2 cores only steals time from training;
- `total_seq_len` = draftsmith's tokens per step (its batch size x the store's mean sample length, rounded up to a
  multiple of 64, at least the longest sample) instead of 8192: speculators packs a step's sequences into one row
  padded to `total_seq_len` and, without FlexAttention, attends densely over the whole row (KV grows to
  `ttt_steps` x the row), so its cost per token grows with the row: at 8192 one step took 140 s on this machine
  (toy store, 2 threads) against 2.5 s at 1024. The same tokens per step also makes the batches alike. With
  draftsmith's 4 sequences of the profiles' ~250-token chats that is 1,024, speculators' fastest setting found here.
`--spec-set key=value` overrides any of its fields (e.g. `total_seq_len=8192`, `hidden_states_dtype=float32`).

Patched here at run time (site-packages is untouched), all because there is no accelerator:
- its trainer moves the model and every batch to `get_local_rank()` (the int 0, i.e. cuda:0): patched to "cpu";
- autocast uses `torch.accelerator`'s device type, "cuda" when there is none: set to "cpu" (bf16 autocast on CPU);
- its step timer calls `torch.accelerator.synchronize()`, which raises without an accelerator: no-op on CPU;
- its `run_training` loop is re-stated without the distributed barriers, with the wall-clock guard below, and
  stopping at `max_steps` (as written, every epoch after `max_steps` still trains one step).
No packages had to be installed: speculators 0.9.0 (installed with --no-deps) imports on this venv as it is
(hs-connectors, datasets, openai, pydantic-settings are already there).
And one adaptation to the data, not to the CPU: a draftsmith store holds the target's final hidden state *after*
its final norm (`lm_head(last_hidden)` = the target logits), while speculators' files hold it *before* (vLLM's last
layer output) and apply the verifier's norm itself; so its `verifier_norm` is replaced by the identity, which makes
its training targets exactly the target's logits over the draft vocabulary, as draftsmith's are. `verifier_norm` is
never saved, so the checkpoint is what speculators would write anyway.

The conversion (once, into `OUT/speculators-data`, not timed): sample i of the store becomes row i of a
`datasets` dataset (`input_ids`, `loss_mask`, `seq_len`, torch format) and `hidden_states/hs_i.safetensors` with
`token_ids` (L,) int64 and `hidden_states` (L, n+1, H) in the store's dtype: the n aux layers in the store's order,
then the final hidden state — speculators' trainer reads `hidden_states[:, :-1]` flattened as its aux input and
`hidden_states[:, -1]` as `verifier_last_hidden_states`. Layer ids need no conversion: draftsmith's id i is the
residual stream entering decoder layer i (transformers' `hidden_states[i]`), which is how speculators and vLLM read
`eagle_aux_hidden_state_layer_ids`; the checkpoint records the store's ids. The verifier speculators reads
(config, tokenizer, embeddings, head, final norm) is the built-in target saved as a Hugging Face directory in
`OUT/verifier`
(`--target`, default: the target the store records).

**draftsmith's side** runs `draftsmith.stages.train` with `TrainConfig`: `ttt_steps` = `--chain`, the settings of
cpu-demo, whose budget is minutes too (batch 4 in one forward, bf16 autocast as speculators', Muon + AdamW at lr
1e-3, max_length 512, speculators' norm switches on, the TTT forward compiled where it can be), warm-up 5 % of the
calibrated steps, four validations, and `max_minutes` = the budget: its trainer re-plans its length from the time
its steps take (up to twice the calibrated steps); `--ds-set key=value` overrides any of them.

**Same wall-clock time**: each trainer first runs a short calibration (a few steps in a scratch directory, not
counted) measuring its time per optimiser step and the cost of its end-of-epoch / validation + checkpoint work;
speculators' `max_steps` is then what fits the budget, so its learning-rate schedule runs to its end (draftsmith's
own budget does that for draftsmith: a 4-step calibration had planned 166 steps where ~230 fit). The timed run also
has a guard: when the next step and the final validation + checkpoint would no longer fit, training stops there
(the schedule then ends early; the table shows planned and done steps). The budget covers each trainer's training loop
(steps, validations, checkpoints), not building the model or loading data. Each trainer runs in its own process.
Time is the one measured thing here, so run it on a quiet machine (`../shared/tools/quiet`): a busy one changes
both trainers' step counts.

The evaluated checkpoint is each trainer's own pick: draftsmith's `best` (validation expected length) and
speculators' `checkpoint_best` (lowest validation loss), else its last epoch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER_FLAG = "--_worker"


# ------------------------------------------------------------------------------------------------ preparation


def save_verifier(out: Path, target_name: str) -> Path:
    """The target as a Hugging Face directory (config, tokenizer, weights) for speculators to read."""
    from draftsmith.target import load_target

    path = out / "verifier"
    stamp = path / "draftsmith_target.txt"
    if stamp.is_file() and stamp.read_text() == target_name:
        return path
    shutil.rmtree(path, ignore_errors=True)
    target = load_target(target_name, packed=False)
    tmp = path.with_name(f".verifier.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    target.model.save_pretrained(tmp)
    target.tokenizer.save_pretrained(tmp)
    (tmp / "draftsmith_target.txt").write_text(target_name)
    os.replace(tmp, path)
    return path


def convert_store(store_path: Path, vocab_path: Path, out: Path) -> Path:
    """The store as speculators' offline training data (see the module docstring), once per store and vocab."""
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from draftsmith.store import HiddenStateStore
    from draftsmith.vocab import DraftVocab

    store = HiddenStateStore(store_path)
    vocab = DraftVocab.load(vocab_path)
    stamp = {
        "store": str(store_path.resolve()),
        "shards": [s.get("sha256") for s in store.manifest["shards"]],
        "samples": len(store),
        "vocab": str(vocab_path.resolve()),
        "draft_vocab_size": len(vocab.d2t),
        "vocab_sum": int(vocab.d2t.sum()),
    }
    path = out / "speculators-data"
    done = path / "converted.json"
    if done.is_file() and json.loads(done.read_text()) == stamp:
        return path
    tmp = path.with_name(f".speculators-data.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n, hidden = len(store.layer_ids), store.hidden_size
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(len(store)):
        sample = store[i]
        length = len(sample["input_ids"])
        rows["input_ids"].append(sample["input_ids"].long().tolist())
        rows["loss_mask"].append(sample["loss_mask"].long().tolist())
        rows["seq_len"].append(length)
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(tmp))
    (tmp / "hidden_states").mkdir()
    for i in range(len(store)):
        sample = store[i]
        length = len(sample["input_ids"])
        states = torch.cat(
            [sample["aux_hidden"].reshape(length, n, hidden), sample["last_hidden"].reshape(length, 1, hidden)], dim=1
        )
        save_file(
            {"hidden_states": states.contiguous(), "token_ids": sample["input_ids"].long().contiguous()},
            str(tmp / "hidden_states" / f"hs_{i}.safetensors"),
        )
    np.save(tmp / f"d2t-{len(vocab.d2t)}.npy", vocab.d2t.cpu().numpy().astype(np.int64))
    np.save(tmp / f"t2d-{len(vocab.d2t)}.npy", vocab.t2d.cpu().numpy().astype(bool))
    (tmp / "converted.json").write_text(json.dumps(stamp, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------ workers


def parse_sets(items: list[str]) -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


class Clock:
    """Times one training loop: step durations, the validation/checkpoint work, and when to stop."""

    def __init__(self, budget_s: float | None, step_s: float, overhead_s: float) -> None:
        self.budget_s, self.step_s, self.overhead_s = budget_s, step_s, overhead_s
        self.start = time.perf_counter()
        self.steps: list[float] = []
        self.overheads: list[float] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def out_of_time(self) -> bool:
        """True when one more step plus the final validation + checkpoint would overrun the budget."""
        if self.budget_s is None:
            return False
        step = statistics.median(self.steps[1:] or self.steps) if self.steps else self.step_s
        return self.elapsed() + step + self.overhead_s > self.budget_s

    def summary(self) -> dict:
        return {
            "step_times": [round(t, 3) for t in self.steps],
            "wall_s": self.elapsed(),
            "steps_done": len(self.steps),
            "step_s": statistics.median(self.steps[1:] or self.steps) if self.steps else None,
            "first_step_s": self.steps[0] if self.steps else None,
            "overhead_s": statistics.median(self.overheads) if self.overheads else 0.0,
            "overheads": len(self.overheads),
        }


def worker_speculators(job: dict) -> dict:
    """speculators' own trainer (`speculators.train.cli.main`), patched only where a CPU needs it."""
    import speculators.train.cli as spec_cli
    import speculators.train.trainer as spec_trainer
    import torch
    from speculators.train.config import TrainConfig

    clock = Clock(job.get("budget_s"), job.get("step_s", 0.0), job.get("overhead_s", 0.0))
    info: dict = {}

    class CpuStepTimer(spec_trainer._StepTimer):  # noqa: SLF001 - its synchronize() raises without an accelerator
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    base = spec_trainer.Trainer

    class CpuTrainer(base):
        """Its trainer on the CPU, timed, stopping at the wall-clock budget; no epoch runs past max_steps."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.device_type = "cpu"
            info["steps_per_epoch"] = len(self.train_loader)
            info["val_batches"] = len(self.val_loader) if self.val_loader is not None else 0

        def train_epoch(self, epoch, *, step_callback=None):
            last = [time.perf_counter()]

            def on_step() -> None:
                now = time.perf_counter()
                clock.steps.append(now - last[0])
                last[0] = now
                if clock.out_of_time():  # the trainer breaks out right after this callback
                    self.config = self.config._replace(max_steps=self.global_step)

            return super().train_epoch(epoch, step_callback=on_step)

        def run_training(self):
            clock.start = time.perf_counter()
            cfg = self.config
            for epoch in range(self.current_epoch, cfg.num_epochs):
                if cfg.max_steps is not None and self.global_step >= self.config.max_steps:
                    break
                self.train_epoch(epoch)
                t = time.perf_counter()
                self.maybe_save_checkpoint(epoch)
                val_metrics = self.val_epoch(epoch) if self.val_loader is not None else None
                self.maybe_update_best(epoch, val_metrics)
                clock.overheads.append(time.perf_counter() - t)
                info["last_epoch"] = epoch
                info["val"] = val_metrics
            info["global_step"] = self.global_step

    spec_trainer.get_local_rank = lambda: "cpu"  # model.to(...) and batch.to(...) used the int 0 = cuda:0
    spec_trainer._StepTimer = CpuStepTimer  # noqa: SLF001
    spec_cli.Trainer = CpuTrainer
    build = spec_cli.build_draft_model

    def build_draft_model(*args, **kwargs):
        model = build(*args, **kwargs)
        model.verifier_norm = torch.nn.Identity()  # the store's last hidden state is already normed (see docstring)
        return model

    spec_cli.build_draft_model = build_draft_model

    steps = int(job["max_steps"])
    spe = job["steps_per_epoch"]
    flat = {
        "verifier_name_or_path": job["verifier"],
        "data_path": job["data"],
        "save_path": str(Path(job["out"]) / "checkpoints"),
        "log_dir": str(Path(job["out"]) / "logs"),
        "d2t_path": job["d2t"],
        "t2d_path": job["t2d"],
        "target_layer_ids": job["layer_ids"],
        "ttt_steps": job["chain"],
        "max_steps": steps,
        "epochs": math.ceil(steps / spe) + 1 if spe else 20,  # our run_training stops at max_steps anyway
        **CPU_SETTINGS,
        **job.get("overrides", {}),
    }
    cfg = TrainConfig.from_sources(cli=flat, argv=["speculators", "train", "(vs_speculators.py)"])
    spec_cli.main(cfg)
    save = Path(job["out"]) / "checkpoints"
    best = save / "checkpoint_best"
    epochs = sorted(int(p.name) for p in save.iterdir() if p.name.isdigit() and not p.is_symlink())
    ckpt = best.resolve() if best.exists() else (save / str(epochs[-1]) if epochs else None)
    val = info.get("val") or {}
    if ckpt is not None and (ckpt / "val_metrics.json").is_file():
        val = json.loads((ckpt / "val_metrics.json").read_text())
    return {
        **clock.summary(),
        "steps_planned": steps,
        "steps_per_epoch": info.get("steps_per_epoch"),
        "checkpoint": str(ckpt) if ckpt else None,
        "val": {k: v for k, v in val.items() if k in ("loss_epoch", "full_acc_0_epoch", "full_acc_1_epoch")},
        "val_metric": ("val top-1 step 0 (draft vocab)", val.get("full_acc_0_epoch")),
        "settings": {k: v for k, v in cfg.flatten().items() if k in SPEC_REPORTED},
    }


# What speculators' trainer needs on a CPU (see the docstring).
CPU_SETTINGS = {
    "draft_attn_impl": "sdpa",  # FlexAttention has no backward on CPU ("does not support backward on CPU")
    "loss_implementation": "eager",  # the fused losses need Triton ("Fused losses require Triton")
    "num_workers": 0,  # 12 spawned loader processes on 2 cores would only steal time from training
    "on_missing": "raise",  # every sample has its hidden states; never call a vLLM endpoint
}

SPEC_REPORTED = (
    "optimizer",
    "lr",
    "muon_lr",
    "loss_implementation",
    "scheduler_type",
    "total_seq_len",
    "hidden_states_dtype",
    "draft_attn_impl",
    "norm_before_fc",
    "norm_before_residual",
    "norm_output",
    "loss_fn",
    "ttt_steps",
    "ttt_step_loss_decay",
    "max_steps",
    "epochs",
    "num_workers",
    "num_layers",
    "sliding_window",
)


def worker_draftsmith(job: dict) -> dict:
    """draftsmith.stages.train with a TrainConfig, timed, stopping at the wall-clock budget."""
    import draftsmith.train.trainer as ds_trainer
    from draftsmith.stages import train
    from draftsmith.target import load_target

    clock = Clock(job.get("budget_s"), job.get("step_s", 0.0), job.get("overhead_s", 0.0))
    base = ds_trainer.Trainer

    class TimedTrainer(base):
        def run(self, resume):
            clock.start = time.perf_counter()
            return super().run(resume)

        def train_step(self):
            start = time.perf_counter()
            out = super().train_step()
            clock.steps.append(time.perf_counter() - start)
            if self.step + 1 < self.total_steps and clock.out_of_time():
                self.total_steps = self.step + 1  # this is the last step: the loop validates and saves after it
            return out

        def validate(self):
            start = time.perf_counter()
            out = super().validate()
            clock.overheads.append(time.perf_counter() - start)
            return out

        def save(self, best=False):
            start = time.perf_counter()
            super().save(best)
            if clock.overheads:
                clock.overheads[-1] += time.perf_counter() - start
            else:
                clock.overheads.append(time.perf_counter() - start)

    ds_trainer.Trainer = TimedTrainer
    steps = int(job["max_steps"])
    budget = job.get("budget_s")
    settings = dict(
        draftsmith_base(),
        ttt_steps=job["chain"],
        # a timed run uses draftsmith's own time budget: it re-plans its length from the measured step time, so
        # a calibration that over- or underestimates the step neither leaves time unused nor overruns
        max_steps=steps if budget is None else 2 * steps,
        max_minutes=None if budget is None else budget / 60,
        warmup_steps=max(1, round(0.05 * steps)),
        eval_every=max(1, math.ceil(steps / 4)),
        checkpoint_every=max(1, math.ceil(steps / 4)),
    )
    settings.update(job.get("overrides", {}))
    cfg = ds_trainer.TrainConfig(**settings)
    target = load_target(job["target"])
    result = train(cfg, Path(job["store"]), Path(job["vocab"]), Path(job["out"]), target, fresh=True)
    val = result.val or {}
    return {
        **clock.summary(),
        "steps_planned": steps,
        "checkpoint": str(Path(job["out"])),
        "val": {k: v for k, v in val.items() if k in ("acc_0", "acc_1", "expected_length", "loss")},
        "val_metric": ("val top-1 step 0 (full vocab)", val.get("acc_0")),
        "settings": cfg.model_dump(mode="json"),
    }


def draftsmith_base() -> dict:
    """cpu-demo's batch, learning rate, optimizer and length (its budget is minutes too, as this benchmark's), read
    from the pipeline so the two cannot drift apart, with bf16 autocast and speculators' three norm switches on."""
    from draftsmith.pipeline import load_pipeline

    demo = load_pipeline("eagle3", "cpu-demo").train
    return dict(batch_size=demo.batch_size, micro_batch_size=demo.micro_batch_size, lr=demo.lr,
                optimizer=demo.optimizer, max_length=demo.max_length, bf16=True, norm_before_fc=True,
                norm_before_residual=True, norm_output=True, compile="auto")  # fmt: skip


def run_worker(kind: str, job: dict, log: Path) -> dict:
    """Run one trainer in its own process (its patches and threads stay there); returns its JSON result."""
    log.parent.mkdir(parents=True, exist_ok=True)
    job_file = log.with_suffix(".job.json")
    result_file = log.with_suffix(".result.json")
    job_file.write_text(json.dumps(job, indent=2))
    result_file.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), TOKENIZERS_PARALLELISM="false")
    with log.open("w") as handle:
        proc = subprocess.run(
            [sys.executable, __file__, WORKER_FLAG, kind, str(job_file), str(result_file)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        )
    if proc.returncode != 0 or not result_file.is_file():
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise SystemExit(f"{kind} worker failed (exit {proc.returncode}); log {log}:\n{tail}")
    return json.loads(result_file.read_text())


def worker_main(argv: list[str]) -> int:
    kind, job_file, result_file = argv
    job = json.loads(Path(job_file).read_text())
    import torch

    torch.set_num_threads(int(job["threads"]))
    torch.manual_seed(0)
    result = (worker_speculators if kind == "speculators" else worker_draftsmith)(job)
    Path(result_file).write_text(json.dumps(result, indent=2, default=str))
    return 0


def train_for(kind: str, job: dict, out: Path, budget_s: float, calib_steps: int) -> dict:
    """Calibrate (a few steps, scratch directory, not counted), then train for the budget."""
    calib_dir = out / f"{kind}-calibration"
    shutil.rmtree(calib_dir, ignore_errors=True)
    calib = run_worker(
        kind,
        job | {"out": str(calib_dir), "max_steps": calib_steps, "budget_s": None},
        out / "logs" / f"{kind}-calibration.log",
    )
    step_s, overhead_s = calib["step_s"], calib["overhead_s"]
    # Overheads: speculators validates and saves once per epoch, draftsmith four times in the run plus `best` saves.
    if kind == "speculators":
        spe = job["steps_per_epoch"]
        steps = max(1, int(budget_s / (step_s + overhead_s / max(spe, 1))))
    else:
        steps = max(1, int((budget_s - 4 * overhead_s) / step_s))
    print(
        f"  {kind}: calibration {calib['steps_done']} steps: {step_s:.2f} s/step, validation + checkpoint "
        f"{overhead_s:.2f} s -> max_steps {steps}",
        flush=True,
    )
    run_dir = out / kind
    shutil.rmtree(run_dir, ignore_errors=True)
    result = run_worker(
        kind,
        job
        | {"out": str(run_dir), "max_steps": steps, "budget_s": budget_s, "step_s": step_s, "overhead_s": overhead_s},
        out / "logs" / f"{kind}.log",
    )
    result["calibration"] = {"steps": calib["steps_done"], "step_s": step_s, "overhead_s": overhead_s}
    return result


def speculators_steps_per_epoch(data: Path, total_seq_len: int, train_ratio: float = 0.9, seed: int = 42) -> int:
    """How many packed batches one epoch of speculators' trainer has (its own sampler, single process)."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = list(load_from_disk(str(data)).with_format(None)["seq_len"])
    lengths = lengths[: int(len(lengths) * train_ratio)]
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=lengths, num_replicas=1, rank=0, seed=seed
    )
    return len(sampler)


# ------------------------------------------------------------------------------------------------ evaluation


def evaluate(checkpoints: dict[str, str], args: argparse.Namespace) -> dict[str, dict]:
    """Both checkpoints in one `draftsmith eval` run: the first as --drafter, the others as --compare, so every
    prompt's baseline, draftsmith and speculators runs sit back to back against one shared baseline."""
    from draftsmith.stages import _safe_name

    exe = Path(sys.executable).with_name("draftsmith")
    out = args.out / "eval"
    names, drafters = list(checkpoints), list(checkpoints.values())
    cmd = [str(exe) if exe.exists() else "draftsmith", "eval", "--target", args.target, "--drafter", drafters[0]]
    for other in drafters[1:]:
        cmd += ["--compare", other]
    cmd += ["--dataset", "mt_bench", "--data-dir", str(args.data_dir), "--limit", str(args.prompts),
            "--max-new-tokens", str(args.max_new_tokens), "--draft-length", "fixed",
            "--num-draft-tokens", str(args.chain), "--out", str(out)]  # fmt: skip
    print("  $ " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    log = args.out / "logs" / "eval.log"
    with log.open("w") as handle:
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-8:])
        print(f"  eval failed (exit {proc.returncode}), log {log}:\n{tail}", flush=True)
        error = {"error": tail.strip().splitlines()[-1] if tail.strip() else f"exit {proc.returncode}"}
        return dict.fromkeys(names, error)
    dirs = [out] + [out / _safe_name(d) for d in drafters[1:]]
    return {name: json.loads((d / "report.json").read_text()) for name, d in zip(names, dirs, strict=True)}


# ------------------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True, help="a `draftsmith extract` directory")
    parser.add_argument("--vocab", type=Path, required=True, help="a `draftsmith vocab` directory (d2t / t2d)")
    parser.add_argument("--minutes", type=float, default=10.0, help="training wall-clock budget of each trainer")
    parser.add_argument("--chain", type=int, default=4, help="TTT depth of both trainers and the fixed eval chain")
    parser.add_argument("--prompts", type=int, default=40, help="first N MT-bench first turns")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/vs_speculators"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", help="the target the store was made with (default: the one it records)")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("DRAFTSMITH_DATA", "../shared/data")))
    parser.add_argument("--calibration-steps", type=int, default=4, help="steps timed before each run (not counted)")
    parser.add_argument("--spec-set", action="append", default=[], help="speculators TrainConfig field=value")
    parser.add_argument("--ds-set", action="append", default=[], help="draftsmith TrainConfig field=value")
    parser.add_argument("--only", choices=("both", "speculators", "draftsmith"), default="both")
    parser.add_argument("--skip-eval", action="store_true")
    args = parser.parse_args()

    from draftsmith.store import HiddenStateStore

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    store = HiddenStateStore(args.store)
    budget_s = args.minutes * 60
    print(
        f"store {args.store}: {len(store)} samples, {store.num_tokens} tokens, layers {list(store.layer_ids)}; "
        f"budget {budget_s:.0f} s per trainer, chain {args.chain}",
        flush=True,
    )

    start = time.perf_counter()
    args.target = args.target or store.manifest["target"]
    verifier = save_verifier(args.out, args.target)
    data = convert_store(args.store, args.vocab, args.out)
    print(f"prepared {verifier} and {data} in {time.perf_counter() - start:.0f} s (not counted)", flush=True)

    spec_overrides = parse_sets(args.spec_set)
    ds_overrides = parse_sets(args.ds_set)
    if "total_seq_len" not in spec_overrides:  # the same tokens per optimiser step as draftsmith's batch (docstring)
        base = draftsmith_base()
        batch = int(ds_overrides.get("batch_size", base["batch_size"]))
        max_length = int(ds_overrides.get("max_length", base["max_length"]))
        lengths = [min(n, max_length) for n in store.lengths()]
        per_step = batch * sum(lengths) / len(lengths)
        spec_overrides["total_seq_len"] = max(max(lengths), 64 * math.ceil(per_step / 64))
    d2t = next(data.glob("d2t-*.npy"))
    common = {"chain": args.chain, "threads": args.threads, "target": args.target}
    jobs = {
        "speculators": common
        | {
            "verifier": str(verifier.resolve()),
            "data": str(data.resolve()),
            "d2t": str(d2t.resolve()),
            "t2d": str(d2t.with_name(d2t.name.replace("d2t", "t2d")).resolve()),
            "layer_ids": list(store.layer_ids),
            "overrides": spec_overrides,
            "steps_per_epoch": speculators_steps_per_epoch(
                data,
                int(spec_overrides["total_seq_len"]),
                float(spec_overrides.get("train_data_ratio", 0.9)),
                int(spec_overrides.get("seed", 42)),
            ),
        },
        "draftsmith": common
        | {
            "store": str(args.store.resolve()),
            "vocab": str(args.vocab.resolve()),
            "overrides": ds_overrides,
        },
    }
    kinds = ["speculators", "draftsmith"] if args.only == "both" else [args.only]
    results: dict[str, dict] = {}
    for kind in kinds:
        print(f"training {kind} for {budget_s:.0f} s ...", flush=True)
        results[kind] = train_for(kind, jobs[kind], args.out, budget_s, args.calibration_steps)
        r = results[kind]
        print(
            f"  {kind}: {r['steps_done']}/{r['steps_planned']} steps in {r['wall_s']:.0f} s; checkpoint "
            f"{r['checkpoint']}",
            flush=True,
        )
    if not args.skip_eval:
        print(f"evaluating {', '.join(reversed(kinds))} against one shared baseline ...", flush=True)
        reports = evaluate({kind: str(results[kind]["checkpoint"]) for kind in reversed(kinds)}, args)
        for kind in kinds:
            results[kind]["eval"] = reports[kind]
    (args.out / "summary.json").write_text(json.dumps(results, indent=2, default=str))
    print_table(results, args)
    return 0


def print_table(results: dict[str, dict], args: argparse.Namespace) -> None:
    header = (
        "trainer",
        "steps done/planned",
        "train wall s",
        "validation",
        "tau_fixed",
        "accept by position",
        "speedup",
        "mismatches",
    )
    rows = []
    for kind, r in results.items():
        ev = r.get("eval") or {}
        name, value = r.get("val_metric", ("", None))
        val = f"{name} {value:.3f}" if isinstance(value, (int, float)) else "-"
        if "error" in ev:
            tau = acc = speed = mism = f"eval failed: {ev['error'][:60]}"
            acc = speed = mism = "-"
        else:
            tau = f"{ev['acceptance_length']:.3f}" if "acceptance_length" in ev else "-"
            acc = " / ".join(f"{a:.2f}" for a in ev.get("acceptance_by_position", [])) or "-"
            speed = f"{ev['speedup']:.2f}x" if "speedup" in ev else "-"
            mism = str(ev.get("mismatches", "-"))
        rows.append((kind, f"{r['steps_done']}/{r['steps_planned']}", f"{r['wall_s']:.0f}", val, tau, acc, speed, mism))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    print()
    print(
        f"MT-bench first {args.prompts} first turns, {args.max_new_tokens} new tokens, T=0, fixed chain "
        f"{args.chain}; {args.minutes:g} min of training each, {args.threads} threads"
    )
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))
    taus = {k: (r.get("eval") or {}).get("acceptance_length") for k, r in results.items()}
    if taus.get("draftsmith") and taus.get("speculators"):
        print(f"\ntau_fixed ratio draftsmith / speculators: {taus['draftsmith'] / taus['speculators']:.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit(main())
