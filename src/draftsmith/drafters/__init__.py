"""Drafters. Directory layouts (EAGLE-3 and DFlash checkpoints, exports) are read by `draftsmith.formats`, which hands a
drafter its weights; this package never reads a layout itself (see `formats.load.build_drafter`)."""

from draftsmith.drafters.base import Draft, Drafter, NullDrafter
from draftsmith.drafters.budget import DraftBudget
from draftsmith.errors import ConfigError
from draftsmith.target import Target, load_target

__all__ = ["BUILTIN_HINT", "Draft", "Drafter", "NullDrafter", "builtin_drafter", "fixed_twin"]

BUILTIN_HINT = (
    "use ngram, ngram:MIN-MAX, model:<hub id or directory>, none, dflash:DIR, or an EAGLE-3 run/checkpoint directory"
)


def builtin_drafter(spec: str, target: Target, dtype: str = "float32") -> Drafter:
    """`ngram`, `ngram:MIN-MAX` (n-gram sizes), `model:ID_OR_DIR` (a small LM) or `none` (plain decoding)."""
    from draftsmith.drafters.draft_model import ModelDrafter
    from draftsmith.drafters.ngram import NgramDrafter

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
    raise ConfigError(f"unknown drafter {spec!r}", hint=BUILTIN_HINT)


def fixed_twin(drafter: Drafter) -> Drafter | None:
    """The same learned drafter (shared weights, its own state) drafting the full chain every round, when `drafter`
    cuts its chains adaptively; None otherwise. Evaluation runs both: quality and end-to-end speed."""
    from draftsmith.drafters.eagle3 import Eagle3Drafter

    if not isinstance(drafter, Eagle3Drafter) or drafter.budget.is_fixed:
        return None
    return Eagle3Drafter(drafter.model, drafter.name, DraftBudget.fixed())
