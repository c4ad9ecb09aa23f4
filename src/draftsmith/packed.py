"""Inference layouts of linear layers on CPU: float32 weights laid out once for a fast kernel, and int8 drafter weights.

Why: a target forward is memory-bound, so in theory a verify forward over a few tokens costs what a one-token decode
costs, but `F.linear` re-packs the weight on every multi-row call (a verify over 2-8 tokens cost ~1.8-2x a decode
step), and oneDNN's packed kernel, packed once at load, still cost ~1.45x from 4 rows on an AMX Xeon. The draft
budget has to win back every bit of that. Three kernels, each with its weight copy made once:
- `linear`: `F.linear` (MKL), fastest for 1-3 rows on an AMX Xeon;
- `onednn`: oneDNN's packed kernel, fastest for many rows (prefill) and, on an AVX512 EPYC, for one (31.2 ms a
  one-token target forward against 44.0 with `F.linear`);
- `rows`: draftsmith's own (`kernels/rows.cpp`, compiled once for this CPU): reads each weight once, a few KB ahead,
  for up to 12 rows at a time, so on the AVX512 EPYC the linears of SmolLM2-135M cost 17-18 ms for 1-8 rows and 22
  for 12 (with 4 rows a pass: 17 / 23 / 29 ms at 1 / 8 / 12; one-off timings, docs/measurements-log.md; whole
  forwards: `benchmarks/verify_cost.py`). Every output is one FMA chain in order, so a row's result does not depend
  on how many rows share the call.
Which kernel serves each row count up to 64 (decode, verify, trees) is timed once a process (`kernel_by_rows`);
above 64 rows (prefill) `F.linear` on the weight itself serves unless oneDNN is clearly faster (`prefill_kernel`), so
that its copy, as large as the weights, is made only where it pays.
Every caller of the model gets the same layers, so `model.generate`, plain decoding and verification stay
comparable, and a speed-up measures speculation, not a faster kernel.

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

from draftsmith.native import native_kernel

BATCH_HINT = 8  # the input-row count oneDNN tunes the packed layout for; measured best over 1-64 rows
TIMED_ROWS = (*range(1, 17), 24, 32, 48, 64)  # decode, verify and tree sizes; above 64 rows: `prefill_kernel`
PREFILL_ROWS = 256  # a prompt's worth of rows, for timing the prefill kernel
TIMING_SHAPE = (4096, 1024)  # the weight kernels are timed on: beyond L2, like a target's layers
KERNELS = ("linear", "onednn", "rows")


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
def kernel_by_rows(kernels: tuple[str, ...] = KERNELS) -> dict[int, str]:
    """The fastest of `kernels` on this CPU for each input-row count up to the last of TIMED_ROWS (a count between
    two timed ones takes the choice of the next one up); `rows` unless another is more than 5 % faster, so that one
    kernel, whose rows do not depend on each other, serves decode and verify alike. Timed once a process
    (`_median_seconds`, 15 calls each): ~1 s."""
    built = native_kernel("rows") is not None
    copies = _timing_copies(tuple(kernel for kernel in kernels if kernel != "rows" or built))
    fastest = {}
    for rows in TIMED_ROWS:
        median = _median_seconds(copies, rows, calls=18)
        fastest[rows] = min(median, key=median.get)
        if "rows" in median and median["rows"] <= 1.05 * median[fastest[rows]]:
            fastest[rows] = "rows"
    return {rows: fastest[min(t for t in TIMED_ROWS if t >= rows)] for rows in range(1, TIMED_ROWS[-1] + 1)}


def _timing_copies(kernels: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each kernel's copy of one TIMING_SHAPE weight (its crossovers matched whole-model forwards on the hosts in
    the module docstring); `linear`'s is the weight itself."""
    weight = torch.randn(TIMING_SHAPE)
    return {kernel: _layout(kernel, weight) for kernel in kernels}


def _median_seconds(copies: dict[str, torch.Tensor], rows: int, calls: int) -> dict[str, float]:
    """Median seconds of each kernel over `rows` input rows, interleaved; the first 3 calls of each only warm the
    caches up."""
    out, features = TIMING_SHAPE
    x = torch.randn(rows, features)
    seconds: dict[str, list[float]] = {kernel: [] for kernel in copies}
    with torch.inference_mode():
        for call in range(calls):
            for kernel, copy in copies.items():
                began = time.perf_counter()
                _linear(kernel, x, copy, None, out)
                if call >= 3:
                    seconds[kernel].append(time.perf_counter() - began)
    return {kernel: statistics.median(times) for kernel, times in seconds.items()}


@functools.cache
def prefill_kernel() -> str:
    """The kernel for more than 64 rows: `linear` (MKL on the weight itself: no copy) unless oneDNN's packed copy is
    more than 25 % faster, timed once a process like `kernel_by_rows`. A prefill is a few % of a request's time and
    the copy is as large as the weights: on the AMX Xeon oneDNN was 1-15 % faster per SmolLM2 linear at 256 rows,
    F.linear's whole prefill within -3 to +6 % of it over 128-512 tokens, and the copy 540 MB of its ~2.1 GB peak
    (docs/measurements-log.md)."""
    median = _median_seconds(_timing_copies(("linear", "onednn")), PREFILL_ROWS, calls=9)
    return "onednn" if median["onednn"] * 1.25 < median["linear"] else "linear"


def _layout(kernel: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight copy `kernel` reads (F.linear reads the weight itself)."""
    if kernel == "rows":
        return native_kernel("rows").pack_weight(weight)
    if kernel == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    return weight


def _linear(kernel: str, x: torch.Tensor, copy: torch.Tensor, bias: torch.Tensor | None, out: int) -> torch.Tensor:
    if kernel == "rows":
        return native_kernel("rows").linear_rows(x, copy, out, bias)
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")
    return nn.functional.linear(x, copy, bias)


class PackedLinear(nn.Module):
    """An inference-only stand-in for `nn.Linear`: same `weight` parameter (state dict, ties and fingerprints are
    unchanged), plus the weight copy each kernel it uses needs (module docstring), made on first use and re-made
    whenever the weight changes (in place, or by `.to()`); dropped by `copy.deepcopy` and pickling."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._copies: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}  # kernel -> (weight's identity, copy)
        self.kernels = kernel_by_rows()  # input-row count -> kernel; beyond it, prefill_kernel()

    def _copy(self, kernel: str) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)  # inference tensors: no version
        if kernel not in self._copies or self._copies[kernel][0] != key:
            self._copies[kernel] = key, _layout(kernel, weight.detach())
        return self._copies[kernel][1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        usable = x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
        training = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        rows = x.numel() // max(x.shape[-1], 1)
        kernel = self.kernels[rows] if rows in self.kernels else prefill_kernel()
        if not usable or training or kernel == "linear":
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return _linear(kernel, x, self._copy(kernel), bias, self.out_features)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_copies": {}}


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
