"""Linear layers with their weights packed once for oneDNN, for float32 inference on CPU.

Why: `F.linear` on CPU re-packs the weight matrix on every call that has more than one input row, and a target
forward is memory-bound, so a verify forward over 2-8 tokens cost ~1.8-2x a one-token forward and the drafter had
to win back that whole difference. Packed once at load, it costs ~1.1-1.4x (SmolLM2-135M, 2 cores, KV cache of 200:
`benchmarks/verify_cost.py`); a one-token forward costs about the same either way. Every caller of the model gets the
same layers, so `model.generate`, plain decoding and verification stay comparable, and a speed-up measures speculation.
"""

import torch
from torch import nn

BATCH_HINT = 8  # the input-row count oneDNN tunes the packed layout for; measured best over 1-64 rows


def can_pack(model: nn.Module) -> bool:
    """oneDNN packing applies to float32 models on CPU in a torch built with oneDNN."""
    param = next(model.parameters())
    return (
        torch.backends.mkldnn.is_available()
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """An inference-only stand-in for `nn.Linear`: same `weight` parameter (state dict, ties and fingerprints are
    unchanged), plus a oneDNN-packed copy that `forward` uses. The copy is re-made whenever the weight changes
    (in place, or by `.to()`), and dropped by `copy.deepcopy` and pickling."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None  # (weight's identity, packed copy)

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)  # inference tensors: no version
        if self._packed is None or self._packed[0] != key:
            self._packed = key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        usable = x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
        if not usable or torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_packed": None}


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a frozen float32 CPU model for a `PackedLinear`; returns how many were swapped."""
    if not can_pack(model):
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    count = 0
    for parent, name, child in swaps:
        if type(child) is nn.Linear:
            setattr(parent, name, PackedLinear(child))
            count += 1
    return count
