"""Per-TTT-step metrics: sums that add up across micro-batches and ranks, a JSONL/TensorBoard log and a PNG.

loss_k is the mean KL(p || q_k) and acc_k the share of positions where the drafter's top-1 (mapped to target ids)
equals the target's top-1 over its full vocabulary, both over the positions that count at step k. acc_k is what
greedy verification would accept at depth k if every earlier draft token had been right. acc_draft_k compares with
the target's top-1 within the draft vocabulary instead (what speculators logs), so the libraries' numbers compare.
chain_k is the share of step-0 positions where steps 0..k were all right: what a fixed chain of greedy drafts
actually gets accepted along the target's own replies, so chain_length = 1 + sum_k chain_k is the validation data's
teacher-forced tau_fixed, exact where expected_length assumes the steps independent.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from draftsmith.errors import DataError
from draftsmith.util import commit_file, temp_path, write_atomic

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


class StepStats:
    """Sums of loss, correct top-1 and counted positions per TTT step, in fp64 so long sums stay exact enough."""

    def __init__(self, data: torch.Tensor) -> None:
        # (5, steps): loss sum, correct (full vocabulary), correct (draft vocabulary), count, whole chains right
        self.data = data

    @classmethod
    def zeros(cls, steps: int, device: torch.device | str = "cpu") -> StepStats:
        return cls(torch.zeros(5, steps, dtype=torch.float64, device=device))

    @property
    def loss_sum(self) -> torch.Tensor:
        return self.data[0]

    @property
    def correct(self) -> torch.Tensor:
        return self.data[1]

    @property
    def correct_draft(self) -> torch.Tensor:
        return self.data[2]

    @property
    def count(self) -> torch.Tensor:
        return self.data[3]

    @property
    def chain(self) -> torch.Tensor:
        """Positions whose drafts at steps 0..k were all right (the denominator is step 0's count)."""
        return self.data[4]

    def __iadd__(self, other: StepStats) -> StepStats:
        self.data += other.data
        return self

    def all_reduce(self) -> StepStats:
        if dist.is_initialized():
            dist.all_reduce(self.data)
        return self

    def summary(self, step_weight: float) -> dict[str, float]:
        """loss (the weighted objective), loss_k, acc_k, acc_draft_k and `expected_length`; NaN-free: a step with
        no positions reports 0. expected_length = 1 + sum_k prod_{j<=k} acc_j, the tokens per verify forward a
        fixed chain of this depth would make if acceptance at each depth were independent. chain_k and chain_length
        = 1 + sum_k chain_k count whole chains instead (the module docstring): how checkpoints rank."""
        count = self.count.clamp_min(1)
        losses, accs = (self.loss_sum / count).tolist(), (self.correct / count).tolist()
        out = {"loss": sum(step_weight**k * loss for k, loss in enumerate(losses))}
        out.update({f"loss_{k}": loss for k, loss in enumerate(losses)})
        out.update({f"acc_{k}": acc for k, acc in enumerate(accs)})
        out.update({f"acc_draft_{k}": acc for k, acc in enumerate((self.correct_draft / count).tolist())})
        reach, expected = 1.0, 1.0
        for acc in accs:
            reach *= acc
            expected += reach
        out["expected_length"] = expected
        chains = (self.chain / count[0]).tolist()
        out.update({f"chain_{k}": chain for k, chain in enumerate(chains)})
        out["chain_length"] = 1.0 + sum(chains)
        out["positions"] = float(self.count.sum())
        return out


class MetricsWriter:
    """Appends {"step", "split", ...} records to metrics.jsonl and, when tensorboard is installed, TensorBoard.

    On resume from step s, records after s (logged before a crash, past the last checkpoint) are dropped, so the
    log of an interrupted and resumed run reads exactly like an uninterrupted one.
    """

    def __init__(self, out_dir: Path, start_step: int) -> None:
        self.path = out_dir / METRICS_FILE
        kept = [json.dumps(r) for r in read_jsonl(self.path) if r["step"] <= start_step]
        write_atomic(self.path, "".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            self.tensorboard = None
        else:
            self.tensorboard = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, "split": split, **values}) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(f"{split}/{name}", value, step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def read_jsonl(path: Path) -> list[dict]:
    """The records of an append-only JSONL log; a torn last line (the process was killed mid-write) is skipped."""
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                raise DataError(
                    f"{path}:{i + 1}: not valid JSON", hint="the log is damaged; fix or delete that line"
                ) from None
    return records


def read_metrics(out_dir: Path) -> list[dict]:
    return read_jsonl(Path(out_dir) / METRICS_FILE)


def plot_curves(out_dir: Path) -> Path:
    """curves.png: loss_k and acc_k per TTT step k against the training step, train (lines) and validation (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(out_dir)
    steps = sum(key.removeprefix("acc_").isdigit() for key in records[0]) if records else 0
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("viridis")
    for metric, ax in zip(("loss", "acc"), axes, strict=True):
        for k in range(steps):
            color = colors(k / max(1, steps - 1))
            for split, style in (("train", {"lw": 1, "alpha": 0.8}), ("val", {"marker": "o", "ls": "--"})):
                rows = [r for r in records if r["split"] == split]
                if rows:
                    label = f"{split} k={k}"
                    ax.plot(
                        [r["step"] for r in rows], [r[f"{metric}_{k}"] for r in rows], color=color, label=label, **style
                    )
        ax.set_xlabel("training step")
        ax.set_ylabel("KL(p || q_k)" if metric == "loss" else "top-1 agreement with the target")
        ax.set_title(f"{metric}_k per training-time-test step k")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(out_dir) / CURVES_FILE
    tmp = temp_path(path, ".png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    commit_file(tmp, path)
    return path
