"""Drafters. Directory layouts (EAGLE-3 and DFlash checkpoints, exports) are read by `draftsmith.formats`, which hands a
drafter its weights; this package never reads a layout itself (see `formats.load.build_drafter`)."""

from draftsmith.decode.tree import TreeShape
from draftsmith.drafters.base import Draft, Drafter, NullDrafter
from draftsmith.drafters.budget import DraftBudget
from draftsmith.errors import ConfigError
from draftsmith.target import Target, load_target

__all__ = [
    "BUILTIN_HINT",
    "Draft",
    "Drafter",
    "NullDrafter",
    "builtin_drafter",
    "fixed_twin",
    "learned_drafter",
    "with_tree",
]

BUILTIN_HINT = (
    "use ngram, ngram:MIN-MAX, model:<hub id or directory>, none, dflash:DIR, or an EAGLE-3 run/checkpoint directory"
)


def builtin_drafter(
    spec: str,
    target: Target,
    dtype: str = "float32",
    tree: TreeShape | None = None,
    budget: DraftBudget | None = None,
) -> Drafter:
    """`ngram`, `ngram:MIN-MAX` (n-gram sizes), `model:ID_OR_DIR` (a small LM) or `none` (plain decoding). With a
    `tree` shape an n-gram drafter proposes trees of that shape (a top-k of 1: a chain); `budget` decides how much of
    a lookup it proposes (drafters/ngram.py)."""
    from draftsmith.drafters.draft_model import ModelDrafter
    from draftsmith.drafters.ngram import NgramDrafter

    if tree is not None and not spec.startswith("ngram"):
        raise ConfigError(
            f"--tree needs an EAGLE-3 or n-gram drafter, not {spec!r}",
            hint="drop --tree, or pass an EAGLE-3 run/checkpoint directory or ngram",
        )

    kind, _, arg = spec.partition(":")
    if kind == "none" and not arg:
        return NullDrafter()
    if kind == "ngram":
        if not arg:
            return with_tree(NgramDrafter(budget=budget), tree)
        lo, _, hi = arg.partition("-")
        if not (lo.isdigit() and (hi or lo).isdigit() and 1 <= int(lo) <= int(hi or lo)):
            raise ConfigError(f"bad n-gram sizes in --drafter {spec!r}", hint="write ngram:MIN-MAX, e.g. ngram:1-4")
        return with_tree(NgramDrafter(int(lo), int(hi or lo), budget=budget), tree)
    if kind == "model" and arg:
        return ModelDrafter(load_target(arg, dtype=dtype), target)
    raise ConfigError(f"unknown drafter {spec!r}", hint=BUILTIN_HINT)


def with_tree(drafter: Drafter, shape: TreeShape | None) -> Drafter:
    """Make a tree-capable drafter (EAGLE-3, DFlash, n-gram) draft trees of `shape` from its next `begin` on: chains
    of `shape.depth` tokens when its top-k is 1, as before when None. EAGLE-3 and DFlash keep their budget: a fixed
    one verifies the whole tree (or chain), an adaptive one the part that pays. A DFlash shape is at most its block's
    B - 1 positions deep."""
    from draftsmith.drafters.dflash import DFlashDrafter
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.merged import MergedDrafter
    from draftsmith.drafters.ngram import NgramDrafter

    if shape is None:
        return drafter
    if isinstance(drafter, MergedDrafter):  # the shape is the first part's; the others add their proposals
        with_tree(drafter.parts[0], shape)
        return drafter
    if not isinstance(drafter, Eagle3Drafter | DFlashDrafter | NgramDrafter):
        raise ConfigError(f"drafter {drafter.name} cannot draft trees", hint="use an EAGLE-3, DFlash or n-gram drafter")
    if isinstance(drafter, Eagle3Drafter):
        shape.check_vocab(drafter.model.config.draft_vocab_size)
    if isinstance(drafter, DFlashDrafter):
        ids = drafter.draft_ids
        shape.check_vocab(drafter.model.config.vocab_size if ids is None else len(ids))
        if shape.depth >= drafter.block_size:
            raise ConfigError(
                f"tree depth {shape.depth} is deeper than the {drafter.block_size - 1} draft positions of this DFlash "
                f"drafter's blocks (block size {drafter.block_size})",
                hint=f"use depth <= {drafter.block_size - 1}",
            )
    drafter.tree = None if shape.is_chain else shape
    return drafter


def learned_drafter(drafter: Drafter) -> Drafter:
    """The first part of a merged drafter (the one a tree shape and the draft length apply to), else `drafter`."""
    from draftsmith.drafters.merged import MergedDrafter

    return drafter.parts[0] if isinstance(drafter, MergedDrafter) else drafter


def fixed_twin(drafter: Drafter) -> Drafter | None:
    """The same learned drafter (shared weights, its own state) drafting the full chain every round, alone, when
    `drafter` cuts its chains adaptively or is merged with others; None otherwise. Evaluation runs both: the
    learned drafter's quality and what the default policy makes of it end to end."""
    from draftsmith.drafters.dflash import DFlashDrafter
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.merged import MergedDrafter

    merged = isinstance(drafter, MergedDrafter)
    learned = learned_drafter(drafter)
    if not isinstance(learned, Eagle3Drafter | DFlashDrafter) or (learned.budget.is_fixed and not merged):
        return None
    if isinstance(learned, DFlashDrafter):
        return DFlashDrafter(learned.model, learned.name)
    return Eagle3Drafter(learned.model, learned.name, DraftBudget.fixed(), precision=learned.precision)


def drafter_precision(drafter: Drafter) -> str | None:
    """The precision an EAGLE-3 drafter (alone or the learned part of a merge) drafts at; None for the others."""
    return getattr(learned_drafter(drafter), "precision", None)


def drafter_costs(drafter: Drafter) -> dict | None:
    """The costs an adaptive EAGLE-3 or DFlash budget measured on this machine at load (in plain decode steps), for the
    report: a speed-up is read against them. None for fixed chains and other drafters."""
    budget = getattr(learned_drafter(drafter), "budget", None)
    if budget is None or budget.is_fixed:
        return None
    return {"forward_costs": [round(c, 3) for c in budget.forward_costs], "step_cost": round(budget.step_cost, 3)}
