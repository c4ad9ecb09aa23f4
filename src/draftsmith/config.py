"""Pydantic models for each stage's settings, so a CLI flag, a YAML profile and a manifest mean the same thing."""

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftsmith.errors import ConfigError


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def checked(cls, **values):
        """Build the config, turning pydantic's multi-line report into one DraftsmithError per bad field."""
        try:
            return cls(**values)
        except ValidationError as exc:
            errors = exc.errors()
            # A field typed as a union (`bf16: bool | "auto"`) fails once per member, each located under the member's
            # type ("bf16.bool"): name the field itself, with what each member wanted.
            same = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
            field = ".".join(str(p) for p in os.path.commonprefix([e["loc"] for e in same])) or cls.__name__
            wanted = " or ".join(dict.fromkeys(e["msg"] for e in same))
            raise ConfigError(
                f"invalid {field}={errors[0].get('input')!r}: {wanted}",
                hint=f"fix {field} (on the command line: --{field.replace('_', '-')})",
            ) from None


class EvalConfig(StageConfig):
    target: str = "smollm2-135m"
    dtype: str = "float32"
    drafter: str = "ngram"
    dataset: str = "builtin"
    data_dir: Path | None = None
    limit: int | None = Field(default=None, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    num_draft_tokens: int = Field(default=7, ge=1, le=64)
    draft_length: Literal["adaptive", "fixed"] = "adaptive"  # EAGLE-3: cut chains and trees that stop paying, or not
    drafter_precision: Literal["auto", "float32", "int8"] = "auto"  # EAGLE-3 weights while drafting (auto: int8 on CPU)
    # An adaptive drafter's fixed-chain twin: timed beside it (speedup_fixed), or at T=0 replayed along the
    # baseline's greedy text (the same acceptance, no speed figures, no extra target run per prompt)
    fixed_chain: Literal["timed", "replayed"] = "timed"
    compare: list[str] = []  # more drafters measured against the same baseline runs (e.g. ngram)
    tree: str | None = None  # draft trees: "depth=D,topk=K,total=N", "auto" (a short tune), or a tune.json
    compare_limit: int | None = Field(default=None, ge=1)  # ... on the first N prompts only
    seed: int = 0
    out: Path = Path("runs/eval")
    engine: Literal["draftsmith", "llama.cpp"] = "draftsmith"  # whose decoding loop runs the drafter
    gguf_target: str = "f32"  # llama.cpp: the target as served: f32 | bf16 | q8_0 | q4_1 | a .gguf file
    threads: int = Field(default=2, ge=1)  # llama.cpp: threads of each llama-server
    draft_threads: int | None = Field(default=None, ge=1)  # llama.cpp: the drafter's own (default: `threads`)
