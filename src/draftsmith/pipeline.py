"""`draftsmith run`: the stages as one resumable plan, with a status file that survives crashes.

A pipeline file (YAML) holds the settings of every stage and named `profiles` that override them (`cpu-demo`,
`cpu-full`, `gpu-1x`, `gpu-8x`): porting a run from a laptop to a rented 8-GPU machine is a change of profile.
`--set train.lr=1e-3` overrides one value. Stages write into RUN_DIR/<stage>.

`RUN_DIR/status.json` records, per stage: pending / in_progress / completed / failed, start and end times, a key
(the hash of the stage's settings and of every upstream key) and the fingerprints of its outputs. A re-run skips
completed stages whose key is unchanged, resumes an interrupted one in place (every stage resumes by itself: the
regeneration, the extract shards, the training checkpoints), and re-runs from scratch a stage whose settings or
inputs changed, and everything downstream of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import Field
from rich.console import Console
from rich.table import Table

from draftsmith import stages as run_stage
from draftsmith.config import EvalConfig, StageConfig
from draftsmith.errors import ConfigError, DataError, DraftsmithError
from draftsmith.target import Target, load_target
from draftsmith.train.trainer import TrainConfig
from draftsmith.util import write_atomic

StageName = Literal["data", "extract", "vocab", "train", "eval"]
STAGES: tuple[StageName, ...] = ("data", "extract", "vocab", "train", "eval")
STATUS_FILE = "status.json"
console = Console(stderr=True, soft_wrap=True)


class EvalStage(EvalConfig):
    """`eval` settings; the pipeline fills in the target, the trained drafter and the output directory."""

    fallback_dataset: str | None = None  # used when `dataset` is not available (a fresh machine without the data)


class PipelineConfig(StageConfig):
    target: str = "smollm2-135m"
    dtype: str = "float32"
    threads: int | None = Field(default=None, ge=1)  # torch CPU threads; None = torch's default
    data_dir: str | None = None  # folder of the benchmark prompt files; `$VARS` are expanded
    stages: list[StageName] = list(STAGES)
    data: run_stage.DataConfig = run_stage.DataConfig()
    extract: run_stage.ExtractConfig = run_stage.ExtractConfig()
    vocab: run_stage.VocabConfig = run_stage.VocabConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalStage = EvalStage(dataset="mt_bench")


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


class Status:
    """RUN_DIR/status.json, rewritten atomically on every change."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / STATUS_FILE
        self.stages: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self.stages = json.loads(self.path.read_text()).get("stages", {})

    def update(self, stage: str, **fields: Any) -> None:
        self.stages.setdefault(stage, {}).update(fields)
        write_atomic(self.path, json.dumps({"stages": self.stages}, indent=2) + "\n")


def _key(stage: str, settings: dict, upstream: str) -> str:
    blob = json.dumps({"stage": stage, "settings": settings, "upstream": upstream}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _fingerprint(directory: Path) -> str | None:
    """A hash of what a stage wrote: its manifest, report or latest checkpoint name (small files that change
    whenever the stage's output does)."""
    for name in ("manifest.json", "report.json", "latest"):
        if (directory / name).is_file():
            return hashlib.sha256((directory / name).read_bytes()).hexdigest()[:16]
    return None


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
        return shared | getattr(self.cfg, stage).model_dump(mode="json")

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
            if entry.get("state") == "completed" and entry.get("key") == key:
                console.print(f"[dim]{stage}: completed earlier ({entry['seconds']:.0f}s), skipped[/]")
                upstream = key
                continue
            if entry.get("key") not in (None, key) and out.exists():
                console.print(f"[yellow]{stage}: settings or inputs changed since the last run; starting it over[/]")
                shutil.rmtree(out)
            console.rule(f"[bold]{stage}")
            start = time.time()
            status.update(stage, state="in_progress", key=key, started=_now(), ended=None, error=None)
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
            status.update(
                stage, state="completed", ended=_now(), seconds=seconds, output=str(out), fingerprint=_fingerprint(out)
            )
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
        run_stage.train(self.cfg.train, self.run_dir / "extract", self.run_dir / "vocab", out, self.target)

    def _eval(self, out: Path) -> None:
        from draftsmith.data.sources import load_eval_prompts

        cfg = self.cfg.eval
        dataset = cfg.dataset
        if cfg.fallback_dataset:
            try:
                load_eval_prompts(dataset, self.data_dir, limit=1)
            except DataError as exc:  # a fresh machine without the data folder or internet still gets a result
                console.print(f"[yellow]{dataset} is not available ({exc.message}); using {cfg.fallback_dataset}[/]")
                dataset = cfg.fallback_dataset
        update = dict(
            target=self.cfg.target, dtype=self.cfg.dtype, drafter=str(self.run_dir / "train"), out=out,
            data_dir=self.data_dir, dataset=dataset,
        )  # fmt: skip
        eval_cfg = EvalConfig(**(cfg.model_dump(exclude={"fallback_dataset"}) | update))
        run_stage.evaluate(eval_cfg, self.target)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_pipeline(
    name_or_path: str, run_dir: Path, profile: str | None = None, sets: list[str] = (), resume_command: str = ""
) -> dict[str, Any]:
    cfg = load_pipeline(name_or_path, profile, sets)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "pipeline.json", cfg.model_dump_json(indent=2) + "\n")
    stage_status = Runner(cfg, run_dir, resume_command).run()
    report = write_run_report(run_dir, cfg, stage_status)
    console.print(f"wrote {report}")
    return stage_status


def status_table(run_dir: Path) -> Table:
    status = Status(run_dir)
    if not status.path.exists():
        raise ConfigError(f"{run_dir} has no {STATUS_FILE}", hint="pass the RUN_DIR of a `draftsmith run`")
    table = Table(title=f"pipeline {run_dir}")
    for column in ("stage", "state", "started", "ended", "seconds", "fingerprint"):
        table.add_column(column)
    for stage, entry in status.stages.items():
        seconds = entry.get("seconds")
        table.add_row(
            stage, entry.get("state", "pending"), entry.get("started") or "", entry.get("ended") or "",
            f"{seconds:.0f}" if seconds is not None else "", entry.get("fingerprint") or entry.get("error") or "",
        )  # fmt: skip
    return table


def write_run_report(run_dir: Path, cfg: PipelineConfig, stage_status: dict[str, Any]) -> Path:
    """RUN_DIR/report.md: how long each stage took, the evaluation of every drafter, and the plots."""
    lines = [f"# draftsmith run: {cfg.target}", "", "| stage | seconds |", "| --- | ---: |"]
    lines += [f"| {s} | {e.get('seconds', 0):.0f} |" for s, e in stage_status.items() if e.get("state") == "completed"]
    total = sum(e.get("seconds", 0) for e in stage_status.values())
    lines += [f"| **total** | {total:.0f} |", ""]
    reports = _eval_reports(run_dir / "eval")
    if reports:
        first = reports[0]
        lines += [
            f"Evaluation on `{first['dataset']}`: {first['prompts']} prompts, {first['max_new_tokens']} new tokens, "
            f"T={first['temperature']}; baseline `model.generate` {first['baseline_tokens_per_s']:.1f} tokens/s.",
            "",
            "| drafter | acceptance length | speedup | tokens/s | mismatches |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r['drafter']} | {r['acceptance_length']:.2f} | {r['speedup']:.2f}x | {r['spec_tokens_per_s']:.1f} | "
            f"{r['mismatches']} |"
            for r in reports
        ]
        plot = _plot_acceptance(reports, run_dir / "eval" / "acceptance.png")
        lines += ["", f"![acceptance by draft position]({plot.relative_to(run_dir)})"]
    if (run_dir / "train" / "curves.png").is_file():
        lines += ["", "![training curves](train/curves.png)"]
    write_atomic(run_dir / "report.md", "\n".join(lines) + "\n")
    return run_dir / "report.md"


def _eval_reports(eval_dir: Path) -> list[dict]:
    files = [eval_dir / "report.json", *sorted(eval_dir.glob("*/report.json"))]
    return [json.loads(f.read_text()) for f in files if f.is_file()]


def _plot_acceptance(reports: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in reports:
        rates = r["acceptance_by_position"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{r['drafter']} (τ={r['acceptance_length']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | proposed)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
