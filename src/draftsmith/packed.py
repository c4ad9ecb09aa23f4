"""Inference layouts of linear layers on CPU: float32 weights packed once for oneDNN, and int8 drafter weights.

Why packed: `F.linear` on CPU re-packs the weight matrix on every call that has more than one input row, and a target
forward is memory-bound, so a verify forward over 2-8 tokens cost ~1.8-2x a one-token forward and the drafter had
to win back that whole difference. Packed once at load, it costs ~1.1-1.4x (SmolLM2-135M, 2 cores, KV cache of 200:
`benchmarks/verify_cost.py`). For a few rows, which kernel is faster depends on the CPU: on an AVX512 EPYC a
one-token target forward took 31.2 ms packed against 44.0 with `F.linear`, while on an AMX Xeon `F.linear` won for
1-3 rows (a 2-token verify 35.2 ms against 47.7 packed; packed from 4 rows on), so the choice is timed once a
process for each row count up to `BATCH_HINT` (`plain_row_counts`). Every
caller of the model gets the same layers, so `model.generate`, plain decoding and verification stay comparable,
and a speed-up measures speculation, not a faster kernel.

Why int8: a drafter step is a handful of one-row matmuls, bound by reading ~26 MB of float32 weights (SmolLM2's
EAGLE-3 layer + a 4096-token head). `Int8Linear` keeps them as int8 rows with one scale each (fbgemm, activations
quantised per call), a quarter of the bytes: 2.4x faster steps on the AVX2 EPYC (`benchmarks/drafter_step.py`).
Only drafters use it: what they propose is verified by the float32 target, so their precision moves acceptance
(a 1-2 % relative error in the logits), never the output.
"""

import functools
import statistics
import time
import warnings

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


@functools.cache
def plain_row_counts() -> frozenset[int]:
    """The input-row counts (1..BATCH_HINT) for which `F.linear` beats oneDNN's packed kernel on this CPU; above
    BATCH_HINT the packed kernel wins everywhere measured. Timed once a process on a 4096x1024 matrix (beyond L2,
    like a target's layers; its crossover matched whole-model forwards on both hosts above), interleaved, median of
    15 calls each: ~0.1 s."""
    weight = torch.randn(4096, 1024)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    plain_wins = set()
    with torch.inference_mode():
        for rows in range(1, BATCH_HINT + 1):
            x = torch.randn(rows, 1024)
            calls = {
                "plain": lambda x=x: nn.functional.linear(x, weight),
                "packed": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            }
            seconds: dict[str, list[float]] = {name: [] for name in calls}
            for rep in range(18):
                for name, call in calls.items():
                    began = time.perf_counter()
                    call()
                    if rep >= 3:  # the first calls warm the caches up
                        seconds[name].append(time.perf_counter() - began)
            if statistics.median(seconds["plain"]) < statistics.median(seconds["packed"]):
                plain_wins.add(rows)
    return frozenset(plain_wins)


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
        self.plain_rows = plain_row_counts()  # calls with these many rows take F.linear (module docstring)

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)  # inference tensors: no version
        if self._packed is None or self._packed[0] != key:
            self._packed = key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        usable = x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
        training = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        plain_rows = x.numel() // max(x.shape[-1], 1) in self.plain_rows
        if not usable or training or plain_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_packed": None}


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a frozen float32 CPU model for a `PackedLinear`; returns how many were swapped."""
    if not can_pack(model):
        return 0
    return _swap(model, (nn.Linear,), PackedLinear)


def _swap(model: nn.Module, kinds: tuple[type, ...], make) -> int:
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    for parent, name, child in swaps:
        if type(child) in kinds:
            setattr(parent, name, make(child))
    return sum(type(child) in kinds for _, _, child in swaps)


def can_quantize(model: nn.Module) -> bool:
    """int8 linears need a float32 model on CPU and a quantized engine (fbgemm on x86, qnnpack on ARM)."""
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.float32 and torch.backends.quantized.engine != "none"


class Int8Linear(nn.Module):
    """An inference-only `nn.Linear` with int8 weights, one scale per output row, and inputs quantised per call.
    The float32 `weight` stays the parameter (state dict, export and fingerprints are unchanged); the int8 copy is
    made once, so weights changed afterwards are not seen (drafters are frozen when they draft)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127).double()
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        bias = None if linear.bias is None else linear.bias.detach().float()
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13; fbgemm's kernel is not
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(rows, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, so AVX2's int8 multiply-add cannot saturate
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)


def quantize_linears(model: nn.Module) -> int:
    """Swap every linear layer of a frozen float32 CPU drafter for an `Int8Linear`; returns how many were swapped."""
    if not can_quantize(model):
        return 0
    return _swap(model, (nn.Linear, PackedLinear), Int8Linear)
