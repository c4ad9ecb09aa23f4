"""Drafters, and `build_drafter` which turns a `--drafter` string into one."""

from pathlib import Path

from draftsmith.drafters.base import Draft, Drafter, NullDrafter
from draftsmith.drafters.budget import DraftBudget, measured_budget
from draftsmith.errors import ConfigError
from draftsmith.target import Target, load_target

__all__ = ["Draft", "Drafter", "NullDrafter", "build_drafter", "fixed_twin"]


def build_drafter(spec: str, target: Target, dtype: str = "float32", draft_length: str = "adaptive") -> Drafter:
    """`ngram`, `ngram:MIN-MAX` (n-gram sizes), `model:ID_OR_DIR` (a small LM), `none` (plain decoding),
    `dflash:DIR` (a DFlash drafter: ours or z-lab's layout; a bare DFlash directory works too), or the
    path of an EAGLE-3 directory: a draftsmith checkpoint or training run, or a speculators / SGLang / EAGLE export
    (converted on load, see `draftsmith.formats`). EAGLE-3 chains are cut where the next token stops paying for
    itself (`draft_length="adaptive"`, see drafters/budget.py) or always run to the full length ("fixed")."""
    from draftsmith.drafters.draft_model import ModelDrafter
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.ngram import NgramDrafter
    from draftsmith.formats.load import load_dflash, load_drafter

    if spec.startswith("dflash:"):
        return load_dflash(spec.removeprefix("dflash:"), target)
    if Path(spec).is_dir():
        drafter = load_drafter(spec, target, budget=DraftBudget.fixed())
        if draft_length == "adaptive" and isinstance(drafter, Eagle3Drafter):
            drafter.budget = measured_budget(target, drafter.step_probe())
        return drafter

    kind, _, arg = spec.partition(":")
    if kind == "none" and not arg:
        return NullDrafter()
    if kind == "ngram":
        if not arg:
            return NgramDrafter()
        lo, _, hi = arg.partition("-")
        if not (lo.isdigit() and (hi or lo).isdigit() and 1 <= int(lo) <= int(hi or lo)):
            raise ConfigError(f"bad n-gram sizes in --drafter {spec!r}", hint="write ngram:MIN-MAX, e.g. ngram:1-4")
        return NgramDrafter(int(lo), int(hi or lo))
    if kind == "model" and arg:
        return ModelDrafter(load_target(arg, dtype=dtype), target)
    raise ConfigError(
        f"unknown drafter {spec!r}",
        hint="use ngram, ngram:MIN-MAX, model:<hub id or directory>, none, dflash:DIR, or an EAGLE-3 "
        "run/checkpoint directory",
    )


def fixed_twin(drafter: Drafter) -> Drafter | None:
    """The same learned drafter (shared weights, its own state) drafting the full chain every round, when `drafter`
    cuts its chains adaptively; None otherwise. Evaluation runs both: quality and end-to-end speed."""
    from draftsmith.drafters.eagle3 import Eagle3Drafter

    if not isinstance(drafter, Eagle3Drafter) or drafter.budget.is_fixed:
        return None
    return Eagle3Drafter(drafter.model, drafter.name, DraftBudget.fixed())
