"""The drafter's optimiser: AdamW, or Muon for the hidden weight matrices with AdamW for the rest (speculators'
default). Both are one `torch.optim.Optimizer` to the trainer, so one LR schedule, one state dict and exact resume
work unchanged."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

BETAS = (0.9, 0.95)


class MuonAdamW(torch.optim.Optimizer):
    """Muon (orthogonalised momentum) over 2-D weight matrices inside the drafter, AdamW over norms and anything
    embedding-like (`embed_tokens`, `lm_head`), as Muon's authors and speculators split them. Muon's step is scaled
    to AdamW's update size (`match_rms_adamw`), so one learning rate serves both groups."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> None:
        named = list(named)
        matrices = [p for n, p in named if p.ndim == 2 and not n.startswith(("embed_tokens", "lm_head"))]
        rest = [p for n, p in named if not any(p is m for m in matrices)]
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest or [nn.Parameter(torch.zeros(1))], lr=lr, betas=BETAS,
                                       weight_decay=weight_decay)  # fmt: skip
        super().__init__([p for n, p in named], {"lr": lr})
        # The schedule writes `lr` into param_groups: make those the two optimisers' own groups.
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ARG002 - the trainer never passes a closure
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def build_optimizer(model: nn.Module, kind: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "muon":
        return MuonAdamW(named, lr, weight_decay)
    return torch.optim.AdamW([p for _, p in named], lr=lr, betas=BETAS, weight_decay=weight_decay)
