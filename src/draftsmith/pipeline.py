"""`draftsmith run`: the stages as one resumable plan, with a status file that survives crashes.

A pipeline file (YAML) holds the settings of every stage and named `profiles` that override them (`cpu-demo`,
`cpu-full`, `gpu-1x`, `gpu-8x`): porting a run from a laptop to a rented 8-GPU machine is a change of profile.
`--set train.lr=1e-3` overrides one value. Stages write into RUN_DIR/<stage>: data, extract, vocab, train, eval,
and, when listed in `stages`, export (a vLLM/SGLang directory), doctor (its checks) and bench (our server under
load, with and without the drafter).

`RUN_DIR/status.json` (see run_status.py) records, per stage: pending / in_progress / completed / failed, start and
end times, a key (the hash of the stage's settings and of every upstream key), and its inputs and outputs with
content fingerprints. A re-run skips completed stages whose key and input fingerprints are unchanged, resumes an
interrupted one in place (every stage resumes by itself: the regeneration, the extract shards, the training
checkpoints), and re-runs from scratch a stage whose settings or inputs changed, and everything downstream of it.

The pipeline is one process, but for the train stage: it runs in a process of its own (`python -m
draftsmith.launch train RUN_DIR`), so that what training leaves in a process never slows the stages timed after
it; with `nproc_per_node: N` as N processes under torchrun, DDP or, with `train.fsdp`, FSDP; its checkpoints resume
with any N, so a crashed 8-GPU run can finish on 4.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import Field, field_validator
from rich.console import Console

from draftsmith import stages as run_stage
from draftsmith.config import EvalConfig, StageConfig
from draftsmith.errors import ConfigError, DataError, DraftsmithError
from draftsmith.run_report import write_run_report
from draftsmith.run_status import Status, file_fingerprint, stage_fingerprint
from draftsmith.target import Target, load_target
from draftsmith.train.trainer import TrainConfig
from draftsmith.util import claim_dir, remove_stage_dir, write_atomic

StageName = Literal["data", "extract", "vocab", "train", "eval", "export", "doctor", "bench"]
STAGES: tuple[StageName, ...] = ("data", "extract", "vocab", "train", "eval", "export", "doctor", "bench")
DEFAULT_STAGES: tuple[StageName, ...] = STAGES[:5]  # export, doctor and bench run when a pipeline lists them
EXECUTION_ONLY = {"train": {"fsdp"}}  # settings that change how a stage runs, never its result: not in its key
console = Console(stderr=True, soft_wrap=True)


class EvalStage(EvalConfig):
    """`eval` settings; the pipeline fills in the target, the trained drafter and the output directory."""

    fallback_dataset: str | None = None  # used when `dataset` is not available (a fresh machine without the data)
    merge_with: list[str] = []  # training-free drafters beside the trained one (e.g. [ngram]; drafters/merged.py)
    merge: Literal["tree", "turns"] = "tree"  # verify every proposal as one tree, or one drafter a round (`A|B`)


class PipelineConfig(StageConfig):
    target: str = "smollm2-135m"
    dtype: str = "float32"
    threads: int | None = Field(default=None, ge=1)  # torch CPU threads; None = torch's default
    data_dir: str | None = None  # folder of the benchmark prompt files; `$VARS` are expanded
    nproc_per_node: int = Field(default=1, ge=1)  # train stage processes (torchrun); the rest is one process
    stages: list[StageName] = list(DEFAULT_STAGES)
    data: run_stage.DataConfig = run_stage.DataConfig()
    extract: run_stage.ExtractConfig = run_stage.ExtractConfig()
    vocab: run_stage.VocabConfig = run_stage.VocabConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalStage = EvalStage(dataset="mt_bench")
    export: run_stage.ExportConfig = run_stage.ExportConfig()
    doctor: run_stage.DoctorConfig = run_stage.DoctorConfig()
    bench: run_stage.BenchStageConfig = run_stage.BenchStageConfig()

    @field_validator("stages")
    @classmethod
    def _in_order(cls, stages: list[str]) -> list[str]:
        """Each stage reads the one before it: a plan lists stages once, in the order of the data flow."""
        if [s for s in STAGES if s in stages] != stages:
            raise ValueError(f"list each stage once, in the order {', '.join(STAGES)}")
        return stages


def shipped_pipelines() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in resources.files("draftsmith.pipelines").iterdir()
                  if p.name.endswith(".yaml"))  # fmt: skip


def read_pipeline_file(name_or_path: str) -> tuple[dict[str, Any], str]:
    """The YAML of a pipeline file, or of a shipped pipeline by name (e.g. `eagle3`), and where it came from."""
    path = Path(name_or_path)
    if path.is_file():
        text, where = path.read_text(), str(path)
    elif name_or_path in shipped_pipelines():
        text = resources.files("draftsmith.pipelines").joinpath(f"{name_or_path}.yaml").read_text()
        where = f"draftsmith/pipelines/{name_or_path}.yaml"
    else:
        raise ConfigError(
            f"no pipeline file {name_or_path!r}",
            hint=f"pass a YAML file or a shipped pipeline: {', '.join(shipped_pipelines())}",
        )
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {str(exc).splitlines()[0]}", hint="fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of settings", hint="see draftsmith/pipelines/eagle3.yaml")
    return raw, where


def load_pipeline(name_or_path: str, profile: str | None = None, sets: list[str] = ()) -> PipelineConfig:
    """Settings = the file's top level, then the profile's overrides, then each `--set key=value`."""
    raw, where = read_pipeline_file(name_or_path)
    profiles = raw.pop("profiles", {}) or {}
    settings = raw
    if profile is not None:
        if profile not in profiles:
            raise ConfigError(
                f"{where} has no profile {profile!r}", hint=f"profiles there: {', '.join(profiles) or 'none'}"
            )
        settings = _merge(settings, profiles[profile] or {})
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad --set {item!r}", hint="write --set section.key=value, e.g. --set train.lr=3e-4")
        settings = _merge(settings, _nested(key.split("."), yaml.safe_load(value)))
    return PipelineConfig.checked(**settings)


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def _nested(keys: list[str], value: Any) -> dict:
    return {keys[0]: value} if len(keys) == 1 else {keys[0]: _nested(keys[1:], value)}


# where a train stage process (`draftsmith.launch`) writes its DraftsmithError for the pipeline to raise
ERROR_FILE_ENV = "DRAFTSMITH_ERROR_FILE"


class Runner:
    def __init__(self, cfg: PipelineConfig, run_dir: Path, resume_command: str) -> None:
        self.cfg, self.run_dir, self.resume_command = cfg, run_dir, resume_command
        self.data_dir = Path(os.path.expandvars(cfg.data_dir)) if cfg.data_dir else None
        self._target: Target | None = None

    @property
    def target(self) -> Target:
        if self._target is None:
            self._target = load_target(self.cfg.target, dtype=self.cfg.dtype)
        return self._target

    def settings(self, stage: StageName) -> dict:
        shared = {"target": self.cfg.target, "dtype": self.cfg.dtype}
        return shared | getattr(self.cfg, stage).model_dump(mode="json", exclude=EXECUTION_ONLY.get(stage, set()))

    def inputs(self, stage: StageName) -> dict[str, Path]:
        """What the stage reads, by name: upstream stage directories (and, for data, the source files)."""
        d = self.run_dir
        if stage == "data":
            cfg = self.cfg.data
            return {s: Path(s) for s in (os.path.expandvars(x) for x in cfg.sources + cfg.optional_sources)}
        drafter = "export" if "export" in self.cfg.stages else "train"
        return {
            "extract": {"data": d / "data"},
            "vocab": {"extract": d / "extract"},
            "train": {"extract": d / "extract", "vocab": d / "vocab"},
            "eval": {"train": d / "train"},
            "export": {"train": d / "train", "extract": d / "extract", "eval": d / "eval"},
            "doctor": {drafter: d / drafter, "extract": d / "extract"},
            "bench": {drafter: d / drafter},
        }[stage]

    def fingerprints(self, stage: StageName) -> dict[str, dict[str, str | None]]:
        return {
            name: {
                "path": str(path),
                "fingerprint": file_fingerprint(path) if stage == "data" else stage_fingerprint(name, path),
            }
            for name, path in self.inputs(stage).items()
        }

    def run(self) -> dict[str, Any]:
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        status = Status(self.run_dir)
        upstream = ""
        for stage in self.cfg.stages:
            key = _key(stage, self.settings(stage), upstream)
            entry = status.stages.get(stage, {})
            out = self.run_dir / stage
            inputs = self.fingerprints(stage)
            if entry.get("state") == "completed" and entry.get("key") == key:
                changed = [n for n, i in inputs.items() if _recorded(entry, n) not in (i["fingerprint"], "unknown")]
                if not changed:
                    console.print(f"[dim]{stage}: completed earlier ({entry['seconds']:.0f}s), skipped[/]")
                    upstream = key
                    continue
                console.print(f"[yellow]{stage}: {', '.join(changed)} changed since it ran; starting it over[/]")
                remove_stage_dir(out, stage)
            elif entry.get("key") not in (None, key) and out.exists():
                console.print(f"[yellow]{stage}: settings or inputs changed since the last run; starting it over[/]")
                remove_stage_dir(out, stage)
            console.rule(f"[bold]{stage}")
            start = time.time()
            status.update(stage, state="in_progress", key=key, started=_now(), ended=None, error=None, inputs=inputs)
            try:
                getattr(self, f"_{stage}")(out)
            except DraftsmithError as exc:
                status.update(stage, state="failed", ended=_now(), error=exc.message)
                raise DraftsmithError(
                    f"stage {stage} failed: {exc.message}",
                    hint=f"{exc.hint + '; then ' if exc.hint else ''}resume with: {self.resume_command}",
                ) from None
            except BaseException as exc:
                status.update(stage, state="failed", ended=_now(), error=f"{type(exc).__name__}: {exc}")
                raise
            seconds = time.time() - start
            fingerprint = stage_fingerprint(stage, out)
            status.update(
                stage, state="completed", ended=_now(), seconds=seconds, output=str(out), fingerprint=fingerprint,
                outputs={stage: {"path": str(out), "fingerprint": fingerprint}},
            )  # fmt: skip
            console.print(f"[green]{stage}: done in {seconds:.0f}s[/]")
            upstream = key
        return status.stages

    def _data(self, out: Path) -> None:
        cfg = self.cfg.data
        needs_target = cfg.regenerate or cfg.synth > 0
        run_stage.data(cfg, out, self.target if needs_target else None)

    def _extract(self, out: Path) -> None:
        run_stage.extract(self.cfg.extract, self.run_dir / "data", out, self.target)

    def _vocab(self, out: Path) -> None:
        run_stage.vocab(self.cfg.vocab, self.run_dir / "extract", out)

    def _train(self, out: Path) -> None:
        """The train stage runs in processes of its own: N under torchrun, else one. A process that has trained
        keeps its state (20+ GB of mapped store and allocator heap on cpu-full, autocast and compile caches), and
        the eval stage timed in it ran slower: a drafter step 0.070 plain decode steps against 0.040, the default
        policy 35.5 against 45.1 tok/s (cpu-full, 2026-12-05; README). Its error comes back as the stage's error."""
        n = self.cfg.nproc_per_node
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] if n > 1 else []
        cmd = [sys.executable, *launcher, "-m", "draftsmith.launch", "train", str(self.run_dir)]
        error_file = self.run_dir / "train.error.json"
        error_file.unlink(missing_ok=True)
        if n > 1:
            console.print(f"train: {n} processes: {' '.join(cmd)}", highlight=False)
        code = subprocess.run(cmd, check=False, env=dict(os.environ, **{ERROR_FILE_ENV: str(error_file)})).returncode
        if error_file.is_file():
            error = json.loads(error_file.read_text())
            error_file.unlink()
            raise DraftsmithError(error["message"], hint=error["hint"])
        if code != 0:
            raise DraftsmithError(
                f"the training process{'es' if n > 1 else ''} exited with code {code}",
                hint="see the output above (the first traceback is the cause)",
            )

    def _eval(self, out: Path) -> None:
        cfg = self.cfg.eval
        update = dict(
            target=self.cfg.target, dtype=self.cfg.dtype, out=out, data_dir=self.data_dir,
            drafter=("+" if cfg.merge == "tree" else "|").join([str(self.run_dir / "train"), *cfg.merge_with]),
            dataset=self.eval_dataset(),
        )  # fmt: skip
        eval_cfg = EvalConfig(**(cfg.model_dump(exclude={"fallback_dataset", "merge_with", "merge"}) | update))
        run_stage.evaluate(eval_cfg, self.target)

    def eval_dataset(self) -> str:
        """The eval dataset, or its fallback where it is not available (a fresh machine without the data folder)."""
        from draftsmith.data.sources import load_eval_prompts

        cfg = self.cfg.eval
        if cfg.fallback_dataset:
            try:
                load_eval_prompts(cfg.dataset, self.data_dir, limit=1)
            except DataError as exc:
                console.print(
                    f"[yellow]{cfg.dataset} is not available ({exc.message}); using {cfg.fallback_dataset}[/]"
                )
                return cfg.fallback_dataset
        return cfg.dataset

    def _export(self, out: Path) -> None:
        d = self.run_dir
        store = d / "extract" if (d / "extract" / "manifest.json").is_file() else None
        report = d / "eval" / "report.json" if (d / "eval" / "report.json").is_file() else None
        run_stage.export(self.cfg.export, d / "train", out, store, report)

    def drafter_dir(self) -> Path:
        """The drafter the shipping stages check and serve: the export when the plan has one, else the checkpoint."""
        return self.run_dir / ("export" if "export" in self.cfg.stages else "train")

    def _doctor(self, out: Path) -> None:
        store = self.run_dir / "extract"
        run_stage.doctor(self.cfg.doctor, self.drafter_dir(), out, self.target, store if store.is_dir() else None)

    def _bench(self, out: Path) -> None:
        cfg = self.cfg.bench
        run_stage.bench(
            cfg, self.cfg.target, self.cfg.dtype, self.drafter_dir(), out, cfg.prompts or self.eval_dataset(),
            self.data_dir, self.cfg.threads,
        )  # fmt: skip


def _key(stage: str, settings: dict, upstream: str) -> str:
    blob = json.dumps({"stage": stage, "settings": settings, "upstream": upstream}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _recorded(entry: dict, name: str) -> str | None:
    """The fingerprint an earlier run recorded for input `name`; "unknown" for a status file without inputs."""
    if "inputs" not in entry:
        return "unknown"
    return (entry["inputs"].get(name) or {}).get("fingerprint")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_pipeline(
    name_or_path: str,
    run_dir: Path,
    profile: str | None = None,
    sets: list[str] = (),
    resume_command: str = "",
    overwrite: bool = False,
) -> dict[str, Any]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "draftsmith run is one process, but it was started by torchrun (WORLD_SIZE is set)",
            hint="run it without torchrun and set nproc_per_node: N; the train stage starts its N processes itself",
        )
    cfg = load_pipeline(name_or_path, profile, sets)
    claim_dir(run_dir, "run", overwrite=overwrite, mark=False)  # its marker is status.json, written first
    Status(run_dir).save()
    write_atomic(run_dir / "pipeline.json", cfg.model_dump_json(indent=2) + "\n")
    stage_status = Runner(cfg, run_dir, resume_command).run()
    report = write_run_report(run_dir, cfg.target, stage_status)
    console.print(f"wrote {report}")
    return stage_status
