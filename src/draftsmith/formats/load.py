"""Read any drafter directory -- ours, speculators, SGLang/EAGLE -- and run it as our `Eagle3Drafter`.

`build_drafter` turns a `--drafter` string into a drafter: a directory goes through `load_drafter`, so `draftsmith
eval --drafter DIR` takes a public EAGLE-3 checkpoint as readily as one of our training runs; anything else is a
built-in drafter (n-gram, small LM, none).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.decode.tree import TreeShape
from draftsmith.drafters import Drafter, builtin_drafter, dflash, with_tree
from draftsmith.drafters.budget import DraftBudget, measured_budget
from draftsmith.drafters.eagle3 import (
    FROZEN,
    Eagle3Drafter,
    Eagle3Model,
    check_compatible,
    read_config,
    resolve_checkpoint,
)
from draftsmith.drafters.merged import MergedDrafter
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.formats import sglang, speculators, zlab
from draftsmith.formats.common import (
    CONFIG_FILE,
    EMBED_KEY,
    Converted,
    check_sizes,
    check_state,
    load_weights,
    read_json,
)
from draftsmith.target import Target


def detect_format(path: str | Path) -> str:
    """draftsmith (a checkpoint or a training run), speculators, or sglang/eagle (the native layout)."""
    path = Path(path)
    if (path / "latest").is_file():
        return "draftsmith"
    raw = read_json(path / CONFIG_FILE)
    if zlab.is_zlab(raw):
        return "zlab"
    if "speculators_model_type" in raw:
        return "speculators"
    if "aux_layer_ids" in raw and "hidden_size" in raw:
        return "draftsmith"
    if sglang.is_native(raw):
        fmt = (raw.get("draftsmith") or {}).get("format")
        return fmt if fmt in sglang.FLAVOURS else "sglang"
    raise DraftsmithError(
        f"{path / CONFIG_FILE} is not an EAGLE-3 drafter config: no speculators_model_type, no "
        "LlamaForCausalLMEagle3 architecture, no draftsmith aux_layer_ids",
        hint="pass a draftsmith run/checkpoint, a speculators EAGLE-3 directory or an SGLang/EAGLE-3 directory",
    )


def checkpoint_dir(path: str | Path) -> Path:
    """The directory that holds the weights: a run's latest checkpoint, else the directory itself."""
    return resolve_checkpoint(path) if detect_format(path) == "draftsmith" else Path(path)


def read_drafter(path: str | Path, num_layers: int | None = None, target: Target | None = None) -> Converted:
    """Any supported directory as our config + state dict (our names), checked for completeness and shapes, and
    first, when `target` is given, for fitting that target (the clearer error when it was trained for another)."""
    fmt = detect_format(path)
    where = str(path)
    # First from the metadata alone (config.json and the weight files' headers), so a config with absurd sizes or
    # weights that do not match it are refused before any tensor is read or allocated.
    for meta in (True, False):
        if fmt == "draftsmith":
            ckpt = resolve_checkpoint(path)
            config = read_config(ckpt)
            check_sizes(config, where)
            state = load_weights(ckpt, meta)
            converted = Converted(config, state, fmt, [f"draftsmith checkpoint {ckpt}"], read_json(ckpt / CONFIG_FILE))
        else:
            raw = read_json(Path(path) / CONFIG_FILE)
            weights = load_weights(Path(path), meta)
            reader = speculators.read if fmt == "speculators" else sglang.read
            converted = reader(raw, weights, num_layers, where)
            check_sizes(converted.config, where)
        if target is not None:
            check_compatible(converted.config, target, where=f"{fmt} drafter {path}:")
        check_state(converted.state, converted.config, where)
    return converted


def build_model(converted: Converted, target: Target) -> Eagle3Model:
    """An `Eagle3Model` on the target's device and dtype: the checkpoint's own embeddings if it has them (as vLLM
    and SGLang would use them), else the target's."""
    model = Eagle3Model(converted.config)
    state = dict(converted.state)
    if EMBED_KEY not in state:
        state.update({k: target.model.get_input_embeddings().weight.detach() for k in FROZEN})
    state = {k: v.to(model.state_dict()[k].dtype) for k, v in state.items()}
    try:
        model.set_vocab(state.pop("d2t"), state.pop("t2d"))
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise DraftsmithError(
            f"{converted.fmt} checkpoint does not fit its config: {str(exc).splitlines()[0]}",
            hint="the checkpoint is damaged; `draftsmith doctor DIR` shows what is wrong",
        ) from None
    param = next(target.model.parameters())
    return model.to(param.device, param.dtype)


def is_dflash(path: str | Path) -> bool:
    """A DFlash drafter directory: a draftsmith DFlash checkpoint or run, z-lab's layout or speculators' DFlash."""
    path = Path(path)
    ckpt = resolve_checkpoint(path) if (path / "latest").is_file() else path
    if not (ckpt / CONFIG_FILE).is_file():
        return False
    raw = read_json(ckpt / CONFIG_FILE)
    return dflash.is_config(raw) or zlab.is_zlab(raw) or speculators.is_dflash(raw)


def read_dflash(
    path: str | Path, target: Target | None = None
) -> tuple[dflash.DFlashConfig, dict[str, torch.Tensor], str, list[str]]:
    """A DFlash directory as (our config, state dict under our names, format, conversion notes), checked against
    `target` when given: layer ids within its depth, mask token inside its vocabulary, hidden sizes."""
    path = Path(path)
    ckpt = resolve_checkpoint(path) if (path / "latest").is_file() else path
    raw = read_json(ckpt / CONFIG_FILE)
    if dflash.is_config(raw):
        config, state, fmt, notes = dflash.read_config(ckpt), load_weights(ckpt), "draftsmith", []
    elif speculators.is_dflash(raw):
        config, state, notes = speculators.read_dflash(raw, load_weights(ckpt), str(ckpt))
        fmt = "speculators"
    else:
        config, state, notes = zlab.read(raw, load_weights(ckpt), str(ckpt))
        fmt = "zlab"
    if target is not None:
        dflash.check_compatible(config, target, where=f"{fmt} DFlash drafter {path}:")
    return config, state, fmt, notes


def load_dflash(path: str | Path, target: Target, name: str | None = None) -> dflash.DFlashDrafter:
    config, state, _, _ = read_dflash(path, target)
    with torch.no_grad():
        model = dflash.build_model(config, state, target)
    return dflash.DFlashDrafter(model, name or f"dflash:{path}")


def load_drafter(
    path: str | Path,
    target: Target,
    name: str | None = None,
    budget: DraftBudget | None = None,
    precision: str = "float32",
) -> Eagle3Drafter | dflash.DFlashDrafter:
    """`--drafter DIR`: our runs and checkpoints, and foreign layouts converted on load, on the target's device;
    an EAGLE-3 drafter drafts at `precision` (float32 | int8, see `Eagle3Drafter`)."""
    if is_dflash(path):
        return load_dflash(path, target, name)
    converted = read_drafter(path, target.num_layers, target)
    with torch.no_grad():
        model = build_model(converted, target)
    return Eagle3Drafter(model, name or f"eagle3:{checkpoint_dir(path)}", budget, precision=precision)


def trained_depth(path: str | Path) -> int | None:
    """How many draft steps a drafter directory was trained to make, where recorded: the training-time test depth
    of a draftsmith run, or the `speculative_tokens` an export declares; a DFlash block's B-1 tokens."""
    if is_dflash(path):
        return read_dflash(path)[0].draft_tokens
    if detect_format(path) == "draftsmith":
        state_file = resolve_checkpoint(path) / "trainer_state.pt"
        if not state_file.is_file():
            return None
        depth = torch.load(state_file, map_location="cpu", weights_only=True).get("config", {}).get("ttt_steps")
        return int(depth) if depth else None
    methods = (read_json(Path(path) / CONFIG_FILE).get("speculators_config") or {}).get("proposal_methods") or [{}]
    depth = methods[0].get("speculative_tokens")
    return int(depth) if depth else None


def merge_separator(spec: str) -> str | None:
    """'+' for a merged spec `A+B` (one tree), '|' for `A|B` (one drafter a round), None for one drafter (an
    existing path may hold either character)."""
    if Path(spec).exists():
        return None
    found = [sep for sep in "+|" if sep in spec]
    if len(found) > 1:
        raise ConfigError(
            f"--drafter {spec!r} mixes '+' and '|'", hint="merge as one tree (A+B) or take turns (A|B), not both"
        )
    return found[0] if found else None


def learned_part(spec: str) -> str:
    """The first drafter of a merged spec `A+B+...` or `A|B|...` (the one the draft length and tree apply to);
    `spec` itself when it names one drafter."""
    sep = merge_separator(spec)
    return spec.split(sep)[0] if sep else spec


def build_drafter(
    spec: str,
    target: Target,
    dtype: str = "float32",
    draft_length: str = "adaptive",
    tree: TreeShape | None = None,
    precision: str = "float32",
) -> Drafter:
    """A `--drafter` string: a drafter directory (an EAGLE-3 or DFlash checkpoint or training run, or a speculators /
    SGLang / EAGLE / z-lab export, converted on load; `dflash:DIR` says which) or a built-in drafter
    (`builtin_drafter`). EAGLE-3 chains are cut where the next token stops paying for itself
    (`draft_length="adaptive"`, see drafters/budget.py) or always run to the full length ("fixed"). With a `tree`
    shape, EAGLE-3, DFlash and n-gram drafters propose trees of that shape instead (a top-k of 1: a chain); an
    adaptive budget verifies the part of each tree that pays (`DraftBudget.choose_tree`), a fixed one all of it.
    `A+B` (e.g. `RUN_DIR+ngram`) verifies both drafters' proposals as one tree; `A|B` lets B draft the rounds where
    it proposes and A the others (drafters/merged.py); the draft length, the tree shape and the EAGLE-3 weights'
    `precision` (float32 | int8) apply to the first."""
    sep = merge_separator(spec)
    if sep is not None:
        first, *rest = spec.split(sep)
        lead = build_drafter(first, target, dtype, draft_length, tree, precision)
        # the others cut their proposals by the forward costs the first measured (measured once, not per part)
        costs = getattr(lead, "budget", DraftBudget.fixed()).forward_costs
        budget = DraftBudget.fixed() if draft_length == "fixed" else DraftBudget(forward_costs=costs, step_cost=0.0)
        parts = [lead] + [builtin_drafter(s, target, dtype, budget=budget) for s in rest]
        return MergedDrafter(parts, take_turns=sep == "|")
    if not spec.startswith("dflash:") and not Path(spec).is_dir():
        budget = measured_budget(target, lambda: None) if draft_length == "adaptive" else DraftBudget.fixed()
        return builtin_drafter(spec, target, dtype=dtype, tree=tree, budget=budget)
    if spec.startswith("dflash:"):
        drafter = load_dflash(spec.removeprefix("dflash:"), target)
    else:
        drafter = load_drafter(spec, target, budget=DraftBudget.fixed(), precision=precision)
    if draft_length == "adaptive" and isinstance(drafter, Eagle3Drafter | dflash.DFlashDrafter):
        rows = 9 if tree is None else max(9, tree.total + 1)  # the forwards it may verify
        drafter.budget = measured_budget(target, drafter.step_probe(), max_new_tokens=rows)
    return with_tree(drafter, tree)
