"""Run llama.cpp's `llama-server` as a child process on a free loopback port, and talk to it.

Requests go to the native `/completion` endpoint with the prompt as *token ids* (draftsmith's own chat rendering)
and `return_tokens`, so what comes back compares token for token with draftsmith's engine and with another server.
Speculation counters come from llama.cpp itself: a response's `timings` carry `draft_n` / `draft_n_accepted`, and
`/metrics` (Prometheus text, `--metrics`) the per-position acceptance counts
(`llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`) and the verify rounds.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from draftsmith.engines.llamacpp import LlamaCpp, LlamaCppError

_METRIC = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})?\s+(\S+)$')


@dataclass(frozen=True)
class Draft:
    """The drafter (EAGLE-3 or DFlash: `spec_type`) a server runs beside its target; `n_min == n_max` and `p_min 0`
    draft a fixed chain, None leaves llama.cpp's default. `threads`: the drafter's own thread count (llama.cpp
    gives it the target's by default; a one-layer drafter may lose more to thread sync than it gains)."""

    model: Path
    n_max: int = 3
    n_min: int | None = None
    p_min: float | None = None
    spec_type: str = "draft-eagle3"
    threads: int | None = None

    def args(self) -> list[str]:
        args = ["-md", str(self.model), "--spec-type", self.spec_type, "--spec-draft-n-max", str(self.n_max)]
        if self.n_min is not None:
            args += ["--spec-draft-n-min", str(self.n_min)]
        if self.p_min is not None:
            args += ["--spec-draft-p-min", str(self.p_min)]
        if self.threads is not None:
            args += ["--spec-draft-threads", str(self.threads), "--spec-draft-threads-batch", str(self.threads)]
        return args


@dataclass
class Completion:
    tokens: list[int]
    seconds: float  # wall clock of the request, prefill included (as `model.generate` is timed)
    timings: dict[str, Any] = field(default_factory=dict)  # llama.cpp's own: predicted_n, draft_n, ...
    stop_type: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`with LlamaServer(lc, "target.gguf", Draft("drafter.gguf")) as server: server.complete(ids, 128)`"""

    def __init__(
        self,
        lc: LlamaCpp,
        model: Path,
        draft: Draft | None = None,
        threads: int = 2,
        ctx_size: int = 4096,
        log: Path | None = None,
        extra: list[str] | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        self.lc, self.model, self.draft = lc, Path(model), draft
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads), "-tb",
            str(threads), "-c", str(ctx_size), "-np", "1", "--metrics", "--no-webui",
            *(draft.args() if draft else []), *(extra or []),
        ]  # fmt: skip
        self.log, self.startup_timeout = log, startup_timeout
        self.lines: deque[str] = deque(maxlen=40)
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.url, timeout=600.0)

    @property
    def command(self) -> str:
        return " ".join([str(self.lc.server), *self.args])

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.proc = subprocess.Popen([str(self.lc.server), *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self.lines)
                raise LlamaCppError(
                    f"`{self.command}` did not start:\n{tail}", hint="run the same command by hand to see why"
                )
            try:
                if self.client.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        sink = self.log.open("a") if self.log else None
        try:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if sink:
                    sink.write(line)
        finally:
            if sink:
                sink.close()

    def stop(self, timeout: float = 15.0) -> None:
        self.client.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def complete(self, prompt_ids: list[int], max_tokens: int, seed: int = 0, **options: Any) -> Completion:
        """Greedy (T=0) completion of a tokenised prompt; `options` go into the request body as they are."""
        body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0.0, "seed": seed,
                "return_tokens": True, "cache_prompt": False, "stream": False, **options}  # fmt: skip
        start = time.perf_counter()
        response = self.client.post("/completion", json=body)
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise LlamaCppError(f"llama-server answered {response.status_code}: {response.text[:300]}",
                                hint=f"see the server log{f' {self.log}' if self.log else ''}")  # fmt: skip
        data = response.json()
        return Completion(list(data.get("tokens") or []), seconds, data.get("timings") or {}, data.get("stop_type", ""))

    def metrics(self) -> dict[str, Any]:
        return parse_metrics(self.client.get("/metrics").text)


def parse_metrics(text: str) -> dict[str, Any]:
    """llama.cpp's Prometheus counters: `{name: value}`, and `accepted_per_pos: [count at position i]`."""
    out: dict[str, Any] = {"accepted_per_pos": []}
    for line in text.splitlines():
        match = _METRIC.match(line.strip())
        if not match:
            continue
        name, pos, value = match.group(1), match.group(2), float(match.group(3))
        if pos is None:
            out[name] = value
        else:
            per_pos = out["accepted_per_pos"]
            per_pos.extend([0] * (int(pos) + 1 - len(per_pos)))
            per_pos[int(pos)] = int(value)
    return out
