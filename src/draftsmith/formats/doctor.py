"""`draftsmith doctor`: check a drafter directory against the target it will be served with.

Every check answers one question that, answered wrongly, makes a drafter load fine and then silently stop being
accepted: do the engine's weight names match, do d2t and t2d agree, do the aux layer ids mean what training meant,
are the target's hidden states (as it will be served: dtype, weights) the ones the drafter was trained on, and does
it actually get drafts accepted. Each check gives PASS, WARN, FAIL or SKIP with one line of explanation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from draftsmith.data.tokenize import encode_chat
from draftsmith.drafters.base import Drafter
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.errors import DraftsmithError
from draftsmith.formats.common import (
    EMBED_KEY,
    OUR_KEYS,
    SGLANG_RULE,
    Converted,
    expected_shapes,
    load_weights,
    read_json,
    required_keys,
)
from draftsmith.formats.load import build_model, checkpoint_dir, detect_format, is_dflash, read_dflash, read_drafter
from draftsmith.formats.speculators import to_speculators_key
from draftsmith.target import Target
from draftsmith.vocab import check_vocab

STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}
ENGINE = {"draftsmith": "draftsmith", "speculators": "vLLM", "eagle": "vLLM (native)", "sglang": "SGLang"}
# Hidden-state agreement: below these the served target is not the one the drafter learned from.
MIN_COSINE, MAX_REL_ERROR = 0.99, 0.10
# Acceptance length (tokens per target forward) at or below which a drafter is effectively useless / weak.
FAIL_ACCEPTANCE, WARN_ACCEPTANCE = 1.1, 1.25
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL | SKIP
    detail: str


def diagnose(
    path: str | Path,
    target: Target | None = None,
    store: str | Path | None = None,
    *,
    samples: int = 4,
    max_tokens: int = 256,
    prompts: int = 4,
    max_new_tokens: int = 32,
    num_draft_tokens: int = 4,
) -> list[Check]:
    """All checks for the drafter at `path`; target-dependent ones are SKIPped without a target or a store."""
    if is_dflash(path):
        return diagnose_dflash(path, target, store, samples=samples, max_tokens=max_tokens, prompts=prompts,
                               max_new_tokens=max_new_tokens)  # fmt: skip
    checks: list[Check] = []
    try:
        fmt = detect_format(path)
    except DraftsmithError as exc:
        return [Check("format", "FAIL", exc.message)]
    checks.append(Check("format", "PASS", f"{fmt} layout, loaded by {ENGINE[fmt]}"))
    weights = load_weights(checkpoint_dir(path))
    try:
        converted = read_drafter(path, target.num_layers if target else None)
    except DraftsmithError as exc:
        checks.append(check_keys(fmt, weights, None))
        checks.append(Check("config", "FAIL", exc.message))
        return checks
    checks.append(check_keys(fmt, weights, converted))
    checks.append(check_config(fmt, converted))
    checks.append(check_shapes(converted, target))
    checks.append(check_vocabulary(converted, target, store))
    checks.append(check_layers(fmt, converted, target, store))
    checks.append(check_fingerprint(converted.config.target_fingerprint, target, store))
    checks.append(check_hidden_states(target, store, samples, max_tokens))
    if any(c.status == "FAIL" for c in checks if c.name in ("weights", "shapes", "vocabulary", "aux layers")):
        checks.append(Check("acceptance", "SKIP", "not run: fix the failures above first"))
    else:
        checks.append(check_acceptance(converted, target, store, prompts, max_new_tokens, num_draft_tokens))
    return checks


def engine_keys(fmt: str, config: Eagle3Config | None = None) -> set[str]:
    """The weight names the format's engine loads for a drafter with `config` (the original layer without one;
    the frozen embeddings are optional everywhere)."""
    ours = required_keys(config) if config is not None else OUR_KEYS
    names = [to_speculators_key(k) for k in ours] if fmt == "speculators" else list(ours)
    return set(names) | {EMBED_KEY}


def check_keys(fmt: str, weights: dict[str, torch.Tensor], converted: Converted | None) -> Check:
    known = engine_keys(fmt, converted.config if converted is not None else None)
    required = known - {EMBED_KEY}
    if converted is not None and converted.config.draft_vocab_size == converted.config.vocab_size:
        required -= {"d2t", "t2d"}  # a full-vocabulary drafter needs no mapping
    unknown = sorted(set(weights) - known)
    missing = sorted(required - set(weights))
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"{ENGINE[fmt]} does not know {unknown} and would skip them without a word")
        if missing:
            parts.append(f"missing {missing}")
        return Check("weights", "FAIL", "; ".join(parts) + " (a renamed key?)")
    return Check("weights", "PASS", f"{len(weights)} tensors, every name one {ENGINE[fmt]} loads, none missing")


def check_config(fmt: str, converted: Converted) -> Check:
    raw = converted.raw_config
    if fmt == "speculators" and "norm_before_residual" not in raw:
        return Check("config", "WARN", "norm_before_residual is missing: vLLM then assumes true, draftsmith false")
    variant = converted.config.variant()
    what = ", ".join(f"{k}={v}" for k, v in variant.items()) if variant else "the original EAGLE-3 layer"
    return Check("config", "PASS", f"architecture switches are ones draftsmith's EAGLE-3 layer runs ({what})")


def check_shapes(converted: Converted, target: Target | None) -> Check:
    cfg = converted.config
    shapes = expected_shapes(cfg)
    wrong = [f"{k} {tuple(v.shape)} != {shapes[k]}" for k, v in converted.state.items() if tuple(v.shape) != shapes[k]]
    if wrong:
        return Check("shapes", "FAIL", "; ".join(wrong[:3]))
    desc = f"hidden {cfg.hidden_size}, {cfg.num_attention_heads}x{cfg.head_dim} heads, vocab {cfg.vocab_size}"
    if target is None:
        return Check("shapes", "PASS", f"consistent with config.json ({desc}); no target to compare with")
    bad = [
        f"{what} {mine} != target's {theirs}"
        for what, mine, theirs in (
            ("hidden size", cfg.hidden_size, target.hidden_size),
            ("vocabulary", cfg.vocab_size, target.vocab_size),
        )
        if mine != theirs
    ]
    if bad:
        return Check("shapes", "FAIL", "; ".join(bad) + ": this drafter belongs to another target")
    heads = target.config.num_attention_heads
    note = "" if heads == cfg.num_attention_heads else f" (target has {heads} heads; the draft layer has its own)"
    return Check("shapes", "PASS", f"fit target {target.name}: {desc}{note}")


def check_vocabulary(converted: Converted, target: Target | None, store: str | Path | None) -> Check:
    cfg, state = converted.config, converted.state
    d2t, t2d = state["d2t"], state["t2d"]
    problems = check_vocab(d2t, t2d, cfg.vocab_size, cfg.draft_vocab_size)
    if problems:
        return Check("vocabulary", "FAIL", problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    special: set[int] = set()
    if target is not None:
        special = set(target.eos_token_ids) | set(getattr(target.tokenizer, "all_special_ids", []))
    elif store is not None:
        special = set(read_json(Path(store) / "manifest.json").get("special_token_ids", []))
    special = {i for i in special if 0 <= i < len(t2d)}
    missing = sorted(i for i in special if not bool(t2d[i]))
    if missing:
        return Check(
            "vocabulary",
            "WARN",
            f"d2t/t2d agree, but special tokens {missing} are not in the draft vocabulary: the drafter can never "
            "propose them (end of turn costs a forward)",
        )
    covered = f", covers the {len(special)} special tokens" if special else ""
    return Check("vocabulary", "PASS", f"d2t/t2d agree on {cfg.draft_vocab_size} draft tokens{covered}")


def check_layers(fmt: str, converted: Converted, target: Target | None, store: str | Path | None) -> Check:
    ids = list(converted.config.aux_layer_ids)
    prov = converted.provenance
    problems: list[str] = []
    if target is not None and max(ids) >= target.num_layers:
        problems.append(
            f"ids {ids} but target {target.name} has {target.num_layers} layers (0..{target.num_layers - 1})"
        )
    if min(ids) < 0:
        problems.append(f"negative id in {ids}")
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        problems.append(f"ids {ids} are not distinct and ascending: engines capture each layer once, in layer order")
    if prov.get("aux_layer_ids") is not None and list(prov["aux_layer_ids"]) != ids:
        problems.append(
            f"config.json's ids now mean inputs of layers {ids}, but the drafter was exported with "
            f"{list(prov['aux_layer_ids'])}: the ids were edited or shifted after export"
        )
    if store is not None:
        stored = list(read_json(Path(store) / "manifest.json").get("layer_ids", []))
        if stored != ids:
            problems.append(f"the store holds layers {stored} but the drafter reads {ids} (shifted ids?)")
    if problems:
        return Check("aux layers", "FAIL", "; ".join(problems))
    note = "; ".join(converted.notes)
    if fmt == "draftsmith" or prov.get("aux_layer_convention"):
        status, stated = "PASS", "convention stated in the checkpoint"
    else:
        status, stated = "WARN", "no draftsmith provenance: the convention is inferred, not stated"
    if fmt == "sglang":
        engine_ids = (converted.raw_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        if engine_ids and engine_ids[0] != 1:
            status = "WARN"
            stated += f"; SGLang versions disagree on ids {engine_ids} ({SGLANG_RULE})"
    return Check("aux layers", status, f"inputs of layers {ids} ({note}); {stated}")


def check_fingerprint(trained: str, target: Target | None, store: str | Path | None) -> Check:
    """`trained`: the fingerprint of the target the drafter was trained for ("" when not recorded)."""
    if store is not None:
        stored = read_json(Path(store) / "manifest.json").get("target_fingerprint")
        if trained and stored != trained:
            return Check(
                "target", "FAIL", f"the drafter was trained for target {trained}, the store was made by {stored}"
            )
    if target is None:
        return Check("target", "SKIP", "no target given (--target)")
    if not trained:
        return Check("target", "WARN", "the checkpoint records no target fingerprint; cannot tell which target it fits")
    served = target.fingerprint()
    if served != trained:
        return Check(
            "target",
            "WARN",
            f"{target.name} (fingerprint {served}) is not bit-identical to the training target ({trained}): another "
            "dtype, quantisation or checkpoint; see the hidden-state check",
        )
    return Check("target", "PASS", f"{target.name} has the same weights the drafter was trained for ({trained})")


@torch.inference_mode()
def check_hidden_states(target: Target | None, store: str | Path | None, samples: int, max_tokens: int) -> Check:
    """Recompute the aux states of a few stored samples with the served target; compare layer by layer."""
    if target is None or store is None:
        return Check("hidden states", "SKIP", "needs --target and --store (the extract store it was trained on)")
    from draftsmith.store import HiddenStateStore

    data = HiddenStateStore(store)
    ids = data.layer_ids
    if max(ids) >= target.num_layers:
        return Check("hidden states", "FAIL", f"store layers {list(ids)} do not exist in {target.name}")
    h = data.hidden_size
    cos_sum = torch.zeros(len(ids), dtype=torch.float64)
    err_sq, ref_sq = torch.zeros(len(ids), dtype=torch.float64), torch.zeros(len(ids), dtype=torch.float64)
    tokens = 0
    for i in range(min(samples, len(data))):
        item = data[i]
        input_ids = item["input_ids"][:max_tokens]
        stored = item["aux_hidden"][:max_tokens].double().view(len(input_ids), len(ids), h)
        fresh = target.forward(input_ids, target.new_cache(), layer_ids=ids).aux_hidden
        fresh = fresh.double().cpu().view(len(input_ids), len(ids), h)
        cos = torch.nn.functional.cosine_similarity(fresh, stored, dim=-1)
        zero = (fresh.abs().amax(-1) == 0) & (stored.abs().amax(-1) == 0)  # e.g. a padding token's embedding row
        cos_sum += torch.where(zero, torch.ones_like(cos), cos).sum(0)
        err_sq += (fresh - stored).pow(2).sum((0, 2))
        ref_sq += stored.pow(2).sum((0, 2))
        tokens += len(input_ids)
    cosine = (cos_sum / tokens).tolist()
    rel = (err_sq.sqrt() / ref_sq.sqrt().clamp_min(1e-30)).tolist()
    per_layer = ", ".join(f"layer {i}: cos {c:.5f} rel.err {r:.2%}" for i, c, r in zip(ids, cosine, rel, strict=True))
    floor = 2 * EPS[data.dtype] + 1e-4  # what rounding to the store's dtype alone explains
    where = f"{tokens} tokens of {min(samples, len(data))} samples, served as {next(target.model.parameters()).dtype}"
    # The manifest says which engine computed the stored states; here transformers recomputes them. Two engines
    # never agree to the last bit (kernels, fused ops), so beyond rounding is expected across engines, not within one.
    made_by = data.manifest.get("backend") or {"name": "transformers"}
    engine = f"{made_by['name']} {made_by.get(made_by['name'], '')}".strip()
    other_engine = made_by["name"] != "transformers"
    if other_engine:
        where += f"; the store was extracted by {engine}, recomputed here with transformers"
    cast = made_by.get("compute_dtype")  # extracted in a copy of the target cast to this dtype (bf16 on AMX CPUs)
    if cast:
        where += f"; the store was computed in a {cast} copy of the target"
    if not all(math.isfinite(x) for x in cosine + rel):
        return Check(
            "hidden states",
            "FAIL",
            f"{per_layer} ({where}): non-finite values: the served target overflows in this dtype (float16?) or the "
            "store is damaged",
        )
    if min(cosine) < MIN_COSINE or max(rel) > MAX_REL_ERROR:
        return Check(
            "hidden states",
            "FAIL",
            f"{per_layer} ({where}): the served target computes different hidden states than the ones the drafter "
            "was trained on. Likely causes: another quantisation or dequantisation path, another checkpoint, another "
            "backend, or another dtype; extract the training states from the target as it is served",
        )
    if max(rel) > floor and other_engine:
        return Check(
            "hidden states",
            "PASS",
            f"{per_layer} ({where}): agree within the differences between two engines' kernels; serve with the "
            f"engine that extracted them ({made_by['name']}) for the acceptance measured in training",
        )
    if max(rel) > floor and cast:
        return Check(
            "hidden states",
            "PASS",
            f"{per_layer} ({where}): agree within {cast} compute rounding, which the drafter was trained through",
        )
    if max(rel) > floor:
        return Check(
            "hidden states",
            "WARN",
            f"{per_layer} ({where}): close, but beyond the {data.manifest['dtype']} rounding of the store "
            f"({floor:.2%}): a different dtype or kernels than at extraction; usually costs a little acceptance",
        )
    return Check("hidden states", "PASS", f"{per_layer} ({where}): identical up to the store's rounding")


def check_acceptance(
    converted: Converted,
    target: Target | None,
    store: str | Path | None,
    prompts: int,
    max_new_tokens: int,
    num_draft_tokens: int,
) -> Check:
    """A short greedy speculative run; an acceptance length near 1 means the drafter is effectively useless."""
    if target is None:
        return Check("acceptance", "SKIP", "needs --target")
    from draftsmith.drafters.eagle3 import Eagle3Drafter

    try:
        with torch.no_grad():
            drafter = Eagle3Drafter(build_model(converted, target))
    except DraftsmithError as exc:
        return Check("acceptance", "FAIL", f"the drafter does not load: {exc.message}")
    return smoke_acceptance(drafter, target, store, prompts, max_new_tokens, num_draft_tokens)


def smoke_acceptance(
    drafter: Drafter, target: Target, store: str | Path | None, prompts: int, max_new_tokens: int, draft_tokens: int
) -> Check:
    from draftsmith.decode.engine import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, drafter, draft_tokens)
    tokens = forwards = 0
    for ids in smoke_prompts(target, store, prompts):
        out = decoder.generate(ids, max_new_tokens)
        tokens += len(out.tokens)
        forwards += out.target_forwards
    tau = tokens / forwards
    line = f"acceptance length {tau:.2f} tokens/forward (greedy, {prompts} prompts, {tokens} tokens)"
    if tau <= FAIL_ACCEPTANCE:
        return Check(
            "acceptance",
            "FAIL",
            f"{line}: the drafter is effectively useless. Likely causes: aux layer ids off by one (convention), "
            "hidden states from another dtype/quantisation/backend, a wrong d2t, a drafter for another target, or "
            "too little training",
        )
    if tau <= WARN_ACCEPTANCE:
        return Check("acceptance", "WARN", f"{line}: low; see the checks above, or train longer")
    return Check("acceptance", "PASS", line)


def diagnose_dflash(
    path: str | Path,
    target: Target | None,
    store: str | Path | None,
    *,
    samples: int,
    max_tokens: int,
    prompts: int,
    max_new_tokens: int,
) -> list[Check]:
    """The checks of a DFlash directory (ours or z-lab's): weights, block size, layer ids and their numbering, mask
    token, hidden sizes, target fingerprint, hidden states against the store, and a greedy acceptance run."""
    from draftsmith.drafters import dflash

    try:
        config, state, fmt, notes = read_dflash(path)
    except DraftsmithError as exc:
        return [Check("format", "PASS", "a DFlash layout"), Check("config", "FAIL", exc.message)]
    engine = "draftsmith" if fmt == "draftsmith" else "SGLang / vLLM / z-lab dflash"
    checks = [Check("format", "PASS", f"{fmt} DFlash layout, loaded by {engine}")]
    expected = {k: tuple(v.shape) for k, v in dflash.DFlashModel(config).state_dict().items() if k not in dflash.FROZEN}
    found = {k: tuple(v.shape) for k, v in state.items()}
    missing, unknown = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    wrong = [f"{k} {found[k]} != {expected[k]}" for k in set(expected) & set(found) if found[k] != expected[k]]
    if missing or unknown or wrong:
        parts = [f"missing {missing[:3]}"] * bool(missing) + [f"unknown {unknown[:3]}"] * bool(unknown) + wrong[:3]
        checks.append(Check("weights", "FAIL", "; ".join(parts)))
    else:
        checks.append(Check("weights", "PASS", f"{len(found)} tensors with the names and shapes of the config"))
    b = config.block_size
    usual = b in (8, 16)
    detail = f"{b}: {b - 1} draft tokens per round" + ("" if usual else "; published drafters use 8 or 16")
    checks.append(Check("block size", "PASS" if usual else "WARN", detail))
    checks.append(check_dflash_target(config, target))
    checks.append(check_dflash_layers(config, notes, target, store))
    checks.append(check_mask_token(config, target, store))
    checks.append(check_fingerprint(config.target_fingerprint, target, store))
    checks.append(check_hidden_states(target, store, samples, max_tokens))
    if any(c.status == "FAIL" for c in checks) or target is None:
        checks.append(Check("acceptance", "SKIP", "needs --target" if target is None else "fix the failures first"))
    else:
        with torch.no_grad():
            drafter = dflash.DFlashDrafter(dflash.build_model(config, state, target))
        checks.append(smoke_acceptance(drafter, target, store, prompts, max_new_tokens, b - 1))
    return checks


def check_dflash_target(config, target: Target | None) -> Check:
    if target is None:
        return Check("hidden sizes", "SKIP", "no target given (--target)")
    sizes = [("hidden size", config.hidden_size, target.hidden_size), ("vocabulary", config.vocab_size,
             target.vocab_size), ("target depth", config.target_num_layers, target.num_layers)]  # fmt: skip
    bad = [f"{what} {mine} != target's {theirs}" for what, mine, theirs in sizes if mine != theirs]
    if bad:
        return Check("hidden sizes", "FAIL", "; ".join(bad) + f": made for {config.target or 'another target'}")
    return Check("hidden sizes", "PASS", f"hidden {config.hidden_size}, vocabulary {config.vocab_size}, "
                 f"{config.target_num_layers} target layers: as {target.name}")  # fmt: skip


def check_dflash_layers(config, notes: list[str], target: Target | None, store: str | Path | None) -> Check:
    ids = list(config.aux_layer_ids)
    depth = target.num_layers if target is not None else config.target_num_layers
    problems = []
    if min(ids) < 0 or max(ids) >= depth:
        problems.append(f"draftsmith ids {ids} (z-lab {[i - 1 for i in ids]}) are outside 0..{depth - 1} of a "
                        f"{depth}-layer target")  # fmt: skip
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        problems.append(f"ids {ids} are not distinct and ascending")
    if store is not None:
        stored = list(read_json(Path(store) / "manifest.json").get("layer_ids", []))
        if stored != ids:
            problems.append(f"the store holds layers {stored} but the drafter reads {ids} (shifted by one?)")
    if problems:
        return Check("target layers", "FAIL", "; ".join(problems))
    return Check("target layers", "PASS", f"inputs of layers {ids} = z-lab outputs of layers {[i - 1 for i in ids]}"
                 + (f" ({'; '.join(notes)})" if notes else ""))  # fmt: skip


def check_mask_token(config, target: Target | None, store: str | Path | None) -> Check:
    """The mask token must be in the vocabulary, and never a token the target writes (its embedding then means
    both "unknown" and that token)."""
    mask = config.mask_token_id
    if target is not None and not 0 <= mask < target.vocab_size:
        return Check("mask token", "FAIL", f"{mask} is outside the target's vocabulary 0..{target.vocab_size - 1}")
    if store is not None:
        from draftsmith.store import HiddenStateStore

        data = HiddenStateStore(store)
        written = sum(int((item["input_ids"][item["loss_mask"].bool()] == mask).sum()) for item in data)
        if written:
            return Check("mask token", "FAIL", f"{mask} is written by the target {written} times in the store")
    if target is None:
        return Check("mask token", "PASS", f"{mask} (vocabulary not checked: no --target)")
    special = mask in target.tokenizer.all_special_ids
    text = target.tokenizer.convert_ids_to_tokens(mask)
    if store is None and not special:
        return Check("mask token", "WARN", f"{mask} ({text!r}) is not a special token; pass --store to check that "
                     "the target never writes it")  # fmt: skip
    return Check("mask token", "PASS", f"{mask} ({text!r})" + (", a special token" if special else "")
                 + (", never written by the target in the store" if store is not None else ""))  # fmt: skip


def smoke_prompts(target: Target, store: str | Path | None, n: int) -> list[list[int]]:
    """Prompts from the training store (the text before the first trained token), else the built-in prompts."""
    if store is not None:
        from draftsmith.store import HiddenStateStore

        data = HiddenStateStore(store)
        out = []
        for i in range(min(n, len(data))):
            item = data[i]
            first = int(item["loss_mask"].float().argmax()) if item["loss_mask"].any() else len(item["input_ids"])
            out.append(item["input_ids"][: max(first, 1)].tolist())
        return out
    from draftsmith.data.sources import load_eval_prompts

    _, convs = load_eval_prompts("builtin", None, n)
    return [encode_chat(target.tokenizer, c.messages) for c in convs]


def serving_target(
    path: str | Path, name: str | None, dtype: str, console: Console
) -> tuple[str | None, Target | None]:
    """The target to check against: `name`, else the one the drafter records (skipped, with a note, if it cannot be
    loaded here: the target checks then say SKIP rather than the whole run failing)."""
    from draftsmith.target import load_target

    if name:
        return name, load_target(name, dtype=dtype)
    try:
        recorded = read_drafter(path).config.target
    except DraftsmithError:
        recorded = ""
    if not recorded:
        return None, None
    try:
        return recorded, load_target(recorded, dtype=dtype)
    except DraftsmithError as exc:
        console.print(f"[yellow]cannot load the recorded target {recorded!r} ({exc.message}); pass --target[/]")
        return None, None


def print_checks(checks: list[Check], title: str, console: Console | None = None) -> None:
    table = Table(title=title, show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{STYLE[c.status]}]{c.status}[/]", c.detail)
    (console or Console()).print(table)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "FAIL" for c in checks) else 0
