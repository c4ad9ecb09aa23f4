"""The draft vocabulary: which target tokens the drafter can propose, as EAGLE-3, SpecForge and speculators store it.

The drafter's lm_head covers `draft_vocab_size` tokens. Draft id i stands for target id `i + d2t[i]`; `t2d` is a
bool mask over the target vocabulary, True for the tokens in the draft vocabulary. The draft ids are ordered by
ascending target id, so the offsets `d2t` are non-negative and `nonzero(t2d) == arange(n) + d2t`.

Selection: the `draft_vocab_size` tokens seen most often under the loss mask (ties broken by the lower token id),
plus every id in `always_include` (special and EOS tokens, so the drafter can end a turn). When the data has fewer
distinct tokens than that, the remaining slots go to unseen target ids, lowest id first (count 0 ties by id too).

On disk (`save`): `vocab.safetensors` holds `d2t` (int64) and `t2d` (bool); `vocab.json` describes the sizes,
the coverage, the source and the most frequent tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import ConfigError, DataError, DraftsmithError
from draftsmith.util import commit_file, temp_path, write_atomic

VOCAB_TENSORS = "vocab.safetensors"
VOCAB_JSON = "vocab.json"
TOP_TOKENS = 50

TokenSource = torch.Tensor | Iterable[tuple[Any, Any]]
"""Per-token counts over the target vocabulary, or (input_ids, loss_mask) pairs to count them from."""


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # (draft_vocab_size,) int64: target_id = draft_id + d2t[draft_id]
    t2d: torch.Tensor  # (target_vocab_size,) bool: target id is in the draft vocabulary
    coverage: float  # share of the counted (loss-masked) tokens that are in the draft vocabulary
    counts: torch.Tensor | None = None  # (target_vocab_size,) int64 token counts it was built from
    always_include: list[int] = field(default_factory=list)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t)

    @property
    def target_vocab_size(self) -> int:
        return len(self.t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        """The target id of each draft id, ascending."""
        return torch.arange(len(self.d2t), dtype=torch.int64, device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        return target_to_draft(target_ids, self.t2d)

    def save(self, out_dir: Path | str, source: dict[str, Any] | None = None) -> Path:
        """Write vocab.safetensors and vocab.json into `out_dir` (each atomically); returns `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(out / VOCAB_TENSORS)
        save_file({"d2t": self.d2t.cpu().contiguous(), "t2d": self.t2d.cpu().contiguous()}, str(tmp))
        commit_file(tmp, out / VOCAB_TENSORS)
        write_atomic(out / VOCAB_JSON, json.dumps(self.describe(source), indent=2) + "\n")
        return out

    def describe(self, source: dict[str, Any] | None = None) -> dict[str, Any]:
        info: dict[str, Any] = {
            "target_vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "coverage": self.coverage,
            "always_include": self.always_include,
            "source": source or {},
        }
        if self.counts is not None:
            total = int(self.counts.sum())
            order = torch.sort(-self.counts, stable=True).indices[:TOP_TOKENS]
            info |= {
                "tokens_counted": total,
                "distinct_tokens": int((self.counts > 0).sum()),
                "top_tokens": [
                    {"id": int(i), "count": int(self.counts[i]), "share": int(self.counts[i]) / max(total, 1)}
                    for i in order
                    if self.counts[i] > 0
                ],
            }
        return info

    @classmethod
    def load(cls, path: Path | str) -> DraftVocab:
        """Read a vocabulary saved by `save` (the directory, or its vocab.safetensors); checks d2t against t2d."""
        path = Path(path)
        tensors_path = path / VOCAB_TENSORS if path.is_dir() else path
        if not tensors_path.is_file():
            raise DraftsmithError(f"{tensors_path} not found", hint="pass the --out directory of `draftsmith vocab`")
        tensors = load_file(str(tensors_path))
        missing = {"d2t", "t2d"} - set(tensors)
        if missing:
            raise DraftsmithError(f"{tensors_path}: expected tensors d2t and t2d, missing {sorted(missing)}")
        problems = check_vocab(tensors["d2t"], tensors["t2d"])
        if problems:
            raise DraftsmithError(f"{tensors_path}: {problems[0]}", hint="rebuild it with `draftsmith vocab`")
        json_path = tensors_path.with_name(VOCAB_JSON)
        info = json.loads(json_path.read_text()) if json_path.is_file() else {}
        return cls(
            d2t=tensors["d2t"],
            t2d=tensors["t2d"],
            coverage=float(info.get("coverage", float("nan"))),
            always_include=list(info.get("always_include", [])),
        )


def count_tokens(source: Iterable[tuple[Any, Any]], target_vocab_size: int) -> torch.Tensor:
    """Counts (int64, one per target id) of the tokens whose loss mask is set, over (input_ids, loss_mask) pairs."""
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    for ids, mask in source:
        ids_t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        mask_t = torch.as_tensor(mask).reshape(-1).bool()
        if ids_t.shape != mask_t.shape:
            raise DataError(f"input_ids has {len(ids_t)} tokens but loss_mask has {len(mask_t)}")
        kept = ids_t[mask_t]
        if len(kept) and (int(kept.min()) < 0 or int(kept.max()) >= target_vocab_size):
            raise DataError(
                f"token ids must be in 0..{target_vocab_size - 1}, found {int(kept.min())}..{int(kept.max())}",
                hint="the target vocabulary size does not match the data's tokenizer",
            )
        counts += torch.bincount(kept, minlength=target_vocab_size)
    return counts


def build_draft_vocab(
    source: TokenSource,
    target_vocab_size: int,
    draft_vocab_size: int,
    always_include: Sequence[int] = (),
) -> DraftVocab:
    """The `draft_vocab_size` most frequent loss-masked tokens (ties by lower id) plus `always_include`."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ConfigError(
            f"draft_vocab_size must be in 1..{target_vocab_size} (the target vocabulary), found {draft_vocab_size}",
            hint="e.g. --draft-vocab-size 8192",
        )
    if isinstance(source, torch.Tensor):
        counts = source.to(torch.int64).reshape(-1).cpu()
        if len(counts) != target_vocab_size:
            raise DataError(f"token counts have {len(counts)} entries, expected {target_vocab_size} (target vocab)")
    else:
        counts = count_tokens(source, target_vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise DataError(
            "no token has loss_mask 1: there is nothing to build a draft vocabulary from",
            hint="the loss mask should cover the assistant turns; check the tokenize stage and the chat template",
        )
    always = sorted(set(int(i) for i in always_include))
    bad = [i for i in always if not 0 <= i < target_vocab_size]
    if bad:
        raise ConfigError(f"always_include ids {bad} are not in the target vocabulary 0..{target_vocab_size - 1}")
    if len(always) > draft_vocab_size:
        raise ConfigError(
            f"always_include has {len(always)} ids, more than draft_vocab_size {draft_vocab_size}",
            hint="raise --draft-vocab-size",
        )
    keys = counts.clone()
    keys[always] = -1  # already in; rank the rest
    order = torch.sort(-keys, stable=True).indices  # descending count, ties by ascending id (a stable sort)
    chosen = torch.cat([torch.tensor(always, dtype=torch.int64), order[: draft_vocab_size - len(always)]])
    draft_ids = torch.sort(chosen).values
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(draft_vocab_size, dtype=torch.int64)
    coverage = int(counts[draft_ids].sum()) / total
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=coverage, counts=counts, always_include=always)


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of draft ids (any shape)."""
    d2t = d2t.to(draft_ids.device)
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids (any shape); -1 for target ids outside the draft vocabulary."""
    t2d = t2d.to(target_ids.device)
    lookup = torch.full(t2d.shape, -1, dtype=torch.int64, device=t2d.device)
    lookup[t2d] = torch.arange(int(t2d.sum()), dtype=torch.int64, device=t2d.device)
    return lookup[target_ids]


def check_vocab(
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> list[str]:
    """Problems with a d2t/t2d pair (empty when consistent): used by `doctor` and when loading a vocabulary."""
    problems = []
    if d2t.dim() != 1 or d2t.dtype not in (torch.int64, torch.int32):
        problems.append(f"d2t should be a 1-D int64 tensor, found {tuple(d2t.shape)} {d2t.dtype}")
    if t2d.dim() != 1 or t2d.dtype != torch.bool:
        problems.append(f"t2d should be a 1-D bool tensor, found {tuple(t2d.shape)} {t2d.dtype}")
    if problems:
        return problems
    if draft_vocab_size is not None and len(d2t) != draft_vocab_size:
        problems.append(f"d2t has {len(d2t)} entries, expected the draft vocab size {draft_vocab_size}")
    if target_vocab_size is not None and len(t2d) != target_vocab_size:
        problems.append(f"t2d has {len(t2d)} entries, expected the target vocab size {target_vocab_size}")
    n_in = int(t2d.sum())
    if n_in != len(d2t):
        problems.append(f"t2d marks {n_in} target tokens but d2t has {len(d2t)} draft tokens")
    if len(d2t) < len(t2d) and len(d2t) and not bool(d2t.any()):
        problems.append(
            f"d2t is all zeros although the draft vocab ({len(d2t)}) is smaller than the target vocab ({len(t2d)}): "
            "every draft id would map to the same target id (d2t was probably never filled in)"
        )
    mapped = torch.arange(len(d2t), dtype=torch.int64) + d2t.cpu().long()
    if len(mapped) and (int(mapped.min()) < 0 or int(mapped.max()) >= len(t2d)):
        problems.append(
            f"d2t maps draft ids to target ids {int(mapped.min())}..{int(mapped.max())}, outside the "
            f"target vocab 0..{len(t2d) - 1}"
        )
    elif n_in == len(d2t):
        expected = torch.nonzero(t2d.cpu()).flatten()
        differ = torch.nonzero(expected != mapped).flatten()
        if len(differ):
            i = int(differ[0])
            problems.append(
                f"d2t and t2d disagree at {len(differ)} draft ids; first at draft id {i}: d2t gives target id "
                f"{int(mapped[i])}, t2d's {i}-th token is {int(expected[i])}"
            )
    return problems


def vocab_from_store(
    store_dir: Path | str,
    draft_vocab_size: int,
    out_dir: Path | str,
    always_include: Sequence[int] | None = None,
) -> DraftVocab:
    """The `draftsmith vocab` stage: count the loss-masked tokens of an extract store, build and save the vocab.

    `always_include` defaults to the target's special and EOS token ids recorded in the store's manifest.
    """
    from draftsmith.store import HiddenStateStore

    store = HiddenStateStore(store_dir) if isinstance(store_dir, str | Path) else store_dir  # or OnlineFeatures
    m = store.manifest
    if always_include is None:
        always_include = m.get("special_token_ids", m.get("eos_token_ids", []))
    vocab = build_draft_vocab(store.iter_tokens(), int(m["vocab_size"]), draft_vocab_size, always_include)
    source = {
        "store": str(Path(store_dir).resolve()) if isinstance(store_dir, str | Path) else m.get("data"),
        "target": m.get("target"),
        "target_fingerprint": m.get("target_fingerprint"),
        "samples": m.get("samples"),
        "masked_tokens": m.get("masked_tokens"),
    }
    out = vocab.save(out_dir, source)
    manifest = {
        "stage": "vocab",
        "inputs": source,
        "config": {"draft_vocab_size": draft_vocab_size, "always_include": vocab.always_include},
        "target_vocab_size": vocab.target_vocab_size,
        "draft_vocab_size": vocab.draft_vocab_size,
        "coverage": vocab.coverage,
        "files": [VOCAB_TENSORS, VOCAB_JSON],
    }
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return vocab
