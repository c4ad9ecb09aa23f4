"""oneDNN-packed linear layers: what `nn.Linear` computes, never stale, safe to copy, off where they cannot work."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from draftsmith.native import native_kernel
from draftsmith.packed import (
    KERNELS,
    TIMED_ROWS,
    Int8Linear,
    PackedLinear,
    can_pack,
    pack_linears,
    quantize_linears,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 64, bias=False))
    net.head = nn.Linear(64, 300, bias=False)
    return net


def run(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net.head(net[2](net[1](net[0](x))))


def needs_rows_kernel(kernel: str) -> None:
    if kernel == "rows" and native_kernel("rows") is None:
        pytest.skip("the row kernel could not be built here (no C++ compiler?); torch's kernels serve")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 24, 33, 65])
def test_packed_layers_compute_what_linear_computes(rows, kernel):
    """Each kernel at each row count up to the last of TIMED_ROWS; above it, the prefill kernel this CPU picks."""
    needs_rows_kernel(kernel)
    plain, packed = model(), model()
    assert pack_linears(packed) == 3 and isinstance(packed.head, PackedLinear)
    for layer in (packed[0], packed[2], packed.head):
        layer.kernels = dict.fromkeys(range(1, TIMED_ROWS[-1] + 1), kernel)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(run(packed, x), run(plain, x), rtol=1e-5, atol=1e-5)
    assert packed.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("prefill", ["linear", "onednn"])
def test_a_prefill_makes_the_copy_of_its_kernel_only(prefill, monkeypatch):
    """Above the timed row counts the prefill kernel serves; oneDNN's copy (as large as the weight) exists only
    when it is the one chosen."""
    import draftsmith.packed

    monkeypatch.setattr(draftsmith.packed, "prefill_kernel", lambda: prefill)
    plain, packed = model(), model()
    pack_linears(packed)
    for layer in (packed[0], packed[2], packed.head):
        layer.kernels = dict.fromkeys(range(1, TIMED_ROWS[-1] + 1), "linear")
    x = torch.randn(TIMED_ROWS[-1] + 7, 64)
    with torch.inference_mode():
        torch.testing.assert_close(run(packed, x), run(plain, x), rtol=1e-5, atol=1e-5)
    assert all(("onednn" in layer._copies) == (prefill == "onednn") for layer in (packed[0], packed[2], packed.head))


def test_the_row_kernel_computes_a_row_alike_whatever_rows_share_the_call():
    """A verify forward over k tokens must compute each position exactly as a one-token decode does: bit for bit,
    at shapes that are not multiples of its 32-column blocks or its 12-row register tiles, over several passes."""
    needs_rows_kernel("rows")
    torch.manual_seed(0)
    layer = nn.Linear(75, 131)
    weight = native_kernel("rows").pack_weight(layer.weight.detach())
    x = torch.randn(30, 75)
    with torch.inference_mode():
        alone = torch.cat([native_kernel("rows").linear_rows(row[None], weight, 131, layer.bias) for row in x])
        for rows in (3, 7, 11, 13, 30):
            together = native_kernel("rows").linear_rows(x[:rows], weight, 131, layer.bias)
            assert torch.equal(together, alone[:rows])
        torch.testing.assert_close(together, layer(x), rtol=1e-5, atol=1e-5)
        assert native_kernel("rows").linear_rows(x.view(30, 1, 75), weight, 131, None).shape == (30, 1, 131)


def test_weight_changes_reach_the_packed_copy_and_deepcopy_works():
    packed = model()
    pack_linears(packed)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = run(packed, x)
    twin = copy.deepcopy(packed)  # the packed copy is not copied; the twin packs its own
    with torch.no_grad():
        packed.head.weight.mul_(2)  # in place, as a quantisation experiment would
    with torch.inference_mode():
        torch.testing.assert_close(run(packed, x), 2 * before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run(twin, x), before)


def test_gradients_and_other_dtypes_use_plain_linear():
    packed = model()
    pack_linears(packed)
    x = torch.randn(2, 64, requires_grad=True)
    run(packed, x).sum().backward()
    assert x.grad is not None and packed.head.weight.grad is not None
    half = model().to(torch.bfloat16)
    assert not can_pack(half) and pack_linears(half) == 0


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_layers_stay_within_a_percent_of_linear_and_keep_the_float_weights(rows):
    plain, int8 = model(), model()
    pack_linears(int8)  # a packed model swaps too: a float32 drafter can be re-held in int8
    assert quantize_linears(int8) == 3 and isinstance(int8.head, Int8Linear)
    assert int8.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(int8.state_dict().values(), plain.state_dict().values(), strict=True))
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want, got = run(plain, x), run(int8, x)
        assert (got - want).norm() < 0.03 * want.norm()
        assert not torch.equal(got, want)  # it is int8 arithmetic, not the float path
        torch.testing.assert_close(run(copy.deepcopy(int8), x), got, rtol=0, atol=0)
    assert quantize_linears(model().to(torch.bfloat16)) == 0


def test_without_a_compiler_torch_kernels_serve_with_a_warning(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    import draftsmith.native as native

    def no_compiler(*args, **kwargs):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native, "KERNEL_CACHE", tmp_path)
    native.native_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="row kernel could not be built .*g\\+\\+: command not found"):
            assert native.native_kernel("rows") is None
    finally:
        native.native_kernel.cache_clear()  # the next caller loads the real build again


def test_kernels_compile_from_a_copy_in_the_cache_rewritten_only_when_the_source_changes(monkeypatch, tmp_path):
    """Two checkouts sharing the cache must not rebuild each other's kernels: the build reads a copy at one path."""
    import torch.utils.cpp_extension

    import draftsmith.native as native

    built = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, sources, **kw: built.append(sources[0]))
    monkeypatch.setattr(native, "KERNEL_CACHE", tmp_path)
    shipped = (Path(native.__file__).parent / "kernels" / "rows.cpp").read_bytes()
    try:
        for _ in range(2):
            native.native_kernel.cache_clear()
            native.native_kernel("rows")
        kept = Path(built[0])
        assert built[0] == built[1] and kept.is_relative_to(tmp_path) and kept.read_bytes() == shipped
        stamp = kept.stat().st_mtime_ns
        native.native_kernel.cache_clear()
        native.native_kernel("rows")
        assert kept.stat().st_mtime_ns == stamp  # unchanged text: not rewritten, so ninja does not rebuild
        kept.write_bytes(b"// an older version\n")
        native.native_kernel.cache_clear()
        native.native_kernel("rows")
        assert kept.read_bytes() == shipped
    finally:
        native.native_kernel.cache_clear()  # the next caller loads the real build again
