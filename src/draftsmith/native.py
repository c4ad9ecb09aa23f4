"""draftsmith's own C++ kernels (`kernels/*.cpp`), compiled for this CPU on first use.

Why compiled here rather than shipped: they are built with `-march=native`, so each host gets the vector width it
has (AVX-512 on the Xeons, AVX2 elsewhere). A build takes ~25 s once and is cached under `KERNEL_CACHE`, keyed by
the CPU's flags and torch's version. Where no build is possible (no C++ compiler or ninja, not Linux) the loader
warns and returns None, and every caller falls back to torch's own kernels, which compute the same function
(rounded differently).
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

KERNEL_CACHE = Path.home() / ".cache" / "draftsmith" / "kernels"
DESCRIPTIONS = {"rows": "row kernel", "decode_attention": "decode attention kernel"}


def _cpu_tag(cpuinfo: Path) -> str:
    """The build is `-march=native`: a cache shared between hosts of different CPUs must not share the binary."""
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(f"{platform.machine()} {flags} {torch.__version__}".encode()).hexdigest()[:10]


@functools.cache
def native_kernel(name: str) -> ModuleType | None:
    """`kernels/NAME.cpp` compiled for this CPU (once, then loaded from `KERNEL_CACHE`), or None with a warning."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return None
    what = DESCRIPTIONS[name]
    module = f"{name}_{_cpu_tag(cpuinfo)}"
    build = KERNEL_CACHE / module
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        # Compiled from a copy in the cache: ninja's build file names its source by path, so two checkouts sharing
        # the cache rebuilt each other's kernel (~25 s) whenever they took turns; a copy rewritten only when its
        # text changes rebuilds only then.
        source = build / f"{name}.cpp"
        shipped = (Path(__file__).parent / "kernels" / f"{name}.cpp").read_bytes()
        changed = not source.is_file() or source.read_bytes() != shipped
        if changed:
            source.write_bytes(shipped)
        if changed or not any(build.glob("*.so")):
            print(f"draftsmith: compiling the {what} for this CPU into {build} (once, ~25 s)", file=sys.stderr)
        flags = ["-O3", "-march=native", "-fopenmp"]
        return load(module, [str(source)], extra_cflags=flags, build_directory=str(build))
    except Exception as error:  # noqa: BLE001 - any build failure leaves torch's own kernels, which are correct
        warnings.warn(f"draftsmith: the {what} could not be built ({error}); using torch's kernels", stacklevel=2)
        return None
