"""Fuzz a live `draftsmith serve`: thousands of generated requests, and the server must answer every one well.

Starts `draftsmith serve` on a loopback port (a tiny random Llama written to a temporary folder, or --target), then
sends --requests generated requests from --concurrency clients: valid completions and chats (plain and streamed)
mutated field by field (wrong types, out-of-range numbers, huge and unicode strings, unknown fields, deep nesting,
truncated or non-JSON bodies, wrong Content-Types and Host headers, unknown paths and methods). Checks:

- every response is a 2xx, or a 4xx whose body is OpenAI's `{"error": {"message", "type", "param", "code"}}`;
- no 5xx, and no response quotes a local path or a Python exception;
- the server still answers afterwards (`/health` is ok, a plain request completes);
- its resident memory grew by less than 32 MiB from after the warm-up to the end.

    PYTHONPATH=src .venv/bin/python benchmarks/fuzz_server.py [--requests 2000] [--concurrency 8] [--seed 0]
        [--target DIR_OR_NAME]

It is a correctness check, not a timing: it can run on a busy machine. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx

from draftsmith.serve.process import ServerProcess

RSS_LIMIT = 32 << 20
WARM_UP = 500  # the allocator and thread pools reach their high-water marks on the same mix of requests
PATHS = ["/v1/completions", "/v1/chat/completions"]
ODD_PATHS = ["/v1/models", "/health", "/metrics", "/v1/nothing", "/", "/v1/completions/x", "/../etc/passwd", "/v1//"]
ODD_VALUES = [None, True, False, 0, -1, 1, 2**63, -(2**70), 1e308, -0.5, 0.5, float("nan"), "", "x", "0", "t5",
              "\u0000", "\udcff", "é" * 50, "𝔘" * 20, [], [1], ["t5"], [[1, 2]], {}, {"a": 1},
              "x" * 100_000]  # fmt: skip
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "echo", "suffix", "tools", "response_format",
          "presence_penalty", "logit_bias", "user", "unknown_field"]  # fmt: skip


def tiny_model(folder: Path) -> Path:
    """A random 2-layer Llama with a word-level tokenizer (`t0`..`t95`): milliseconds per token."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=1, pad_token_id=1, bos_token_id=0, tie_word_embeddings=False)  # fmt: skip
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    LlamaForCausalLM(config).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t1").save_pretrained(folder)
    return folder


class Generator:
    """Seeded requests: (method, path, headers, body bytes, is_stream)."""

    def __init__(self, seed: int, model: str) -> None:
        self.rng, self.model = random.Random(seed), model

    def words(self, n: int) -> str:
        return " ".join(f"t{self.rng.randrange(2, 96)}" for _ in range(n))

    def valid(self, path: str) -> dict:
        r = self.rng
        body: dict = {"model": self.model, "max_tokens": r.randint(1, 12), "temperature": r.choice([0, 0.7, 1.0])}
        if path.endswith("chat/completions"):
            roles = ["system", "user", "assistant", "developer"]
            body["messages"] = [{"role": r.choice(roles), "content": self.words(r.randint(1, 8))}
                                for _ in range(r.randint(1, 4))]  # fmt: skip
            body["messages"][-1]["role"] = "user"
        else:
            body["prompt"] = self.words(r.randint(1, 10)) if r.random() < 0.8 else [r.randrange(2, 96) for _ in "abc"]
        if r.random() < 0.3:
            body["stream"] = True
            body["stream_options"] = {"include_usage": r.random() < 0.5}
        if r.random() < 0.3:
            body["stop"] = [self.words(1) for _ in range(r.randint(1, 4))]
        if r.random() < 0.2:
            body["seed"] = r.randrange(2**31)
        return body

    def mutate(self, body: dict) -> dict:
        r = self.rng
        for _ in range(r.randint(1, 3)):
            kind = r.random()
            if kind < 0.5:
                body[r.choice(FIELDS)] = r.choice(ODD_VALUES)
            elif kind < 0.7 and body:
                body.pop(r.choice(list(body)))
            elif kind < 0.85 and "messages" in body:
                body["messages"] = r.choice([
                    [{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": r.choice(ODD_VALUES)}],
                    [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                    [{"role": "user", "content": "t5"}] * r.choice([0, 1025]), "hello", [[[]]],
                ])  # fmt: skip
            else:
                depth = r.choice([10, 500, 5000])
                body[r.choice(FIELDS)] = json.loads("[" * min(depth, 500) + "]" * min(depth, 500))
        return body

    def request(self) -> tuple[str, str, dict[str, str], bytes, bool]:
        r = self.rng
        path = r.choice(PATHS)
        headers = {"content-type": "application/json"}
        body = self.valid(path)
        roll = r.random()
        if roll < 0.45:
            raw = json.dumps(body).encode()
        elif roll < 0.75:
            raw = json.dumps(self.mutate(body), allow_nan=True).encode(errors="surrogatepass")
        elif roll < 0.82:
            raw = r.choice([b"", b"{", b"[" * 100_000, b"\xff\xfe", b"null", b'{"prompt": "t5"' * 1000,
                            json.dumps(body).encode()[: r.randrange(1, 20)], b"{}" * 10])  # fmt: skip
        elif roll < 0.88:
            headers["content-type"] = r.choice(["text/plain", "application/x-www-form-urlencoded", "", "json",
                                                "multipart/form-data; boundary=x"])  # fmt: skip
            raw = json.dumps(body).encode()
        elif roll < 0.92:
            headers["host"] = r.choice(["evil.example", "127.0.0.1.evil.example:80", "localhost.", "[::2]"])
            raw = json.dumps(body).encode()
        elif roll < 0.96:
            return r.choice(["GET", "PUT", "DELETE", "POST"]), r.choice(ODD_PATHS), headers, b"{}", False
        else:
            body["stop"] = ["t" + "x" * r.choice([10, 1024, 1025, 60_000]) for _ in range(r.choice([1, 16, 17]))]
            raw = json.dumps(body).encode()
        return "POST", path, headers, raw, bool(body.get("stream") is True)


def check(status: int, content: bytes, ctype: str, stream: bool) -> str | None:
    """What is wrong with one response, or None."""
    if status >= 500:
        return f"{status}: {content[:200]!r}"
    text = content.decode("utf-8", "replace")
    if "Traceback" in text or "/tmp/" in text or "/home/" in text:
        return f"{status} leaks: {text[:200]!r}"
    if 400 <= status < 500:
        try:
            error = json.loads(content)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without an OpenAI error body: {text[:200]!r}"
        if set(error) != {"message", "type", "param", "code"} or not isinstance(error["message"], str):
            return f"{status} with a malformed error body: {error}"
        return None
    if not 200 <= status < 300:
        return f"unexpected status {status}"
    if ctype.startswith("text/event-stream"):
        return None if text.rstrip().endswith("data: [DONE]") else f"stream without [DONE]: {text[-200:]!r}"
    if ctype.startswith("application/json") or ctype.startswith("text/plain"):
        return None
    return f"{status} with content-type {ctype!r}"


async def fuzz(url: str, gen: Generator, n: int, concurrency: int, problems: list[str], statuses: Counter) -> None:
    todo = iter(range(n))
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def worker() -> None:
            for _ in todo:
                method, path, headers, raw, stream = gen.request()
                try:
                    r = await client.request(method, path, content=raw, headers=headers)
                except httpx.HTTPError as exc:
                    problems.append(f"{method} {path}: transport error {type(exc).__name__}: {exc}")
                    continue
                statuses[r.status_code] += 1
                problem = check(r.status_code, r.content, r.headers.get("content-type", ""), stream)
                if problem:
                    problems.append(f"{method} {path} {raw[:80]!r}: {problem}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def resident(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default=None, help="default: a tiny random Llama in a temporary folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target or str(tiny_model(Path(tmp) / "model"))
        serve_args = ["--target", target, "--drafter", "ngram", "--threads", "1", "--max-active", "4",
                      "--max-queue", "8", "--model-name", "fuzz",
                      "--refusal-hold", "0"]  # fmt: skip  # its bad requests would otherwise be answered slowly
        with ServerProcess(serve_args, log=Path(tmp) / "server.log", env={"OMP_NUM_THREADS": "1"}) as server:
            gen, problems, statuses = Generator(args.seed, "fuzz"), [], Counter()
            asyncio.run(fuzz(server.url, gen, WARM_UP, args.concurrency, problems, statuses))
            before = resident(server.pid)
            asyncio.run(fuzz(server.url, gen, args.requests, args.concurrency, problems, statuses))
            after = resident(server.pid)
            with httpx.Client(base_url=server.url, timeout=60) as client:
                health = client.get("/health")
                ok = client.post("/v1/completions", json={"model": "fuzz", "prompt": "t5 t6", "max_tokens": 3})
            log = (Path(tmp) / "server.log").read_text()
    sent = WARM_UP + args.requests
    print(
        f"{sent} requests ({args.requests} after a {WARM_UP}-request warm-up); "
        f"statuses: {dict(sorted(statuses.items()))}"
    )
    print(f"resident memory: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({(after - before) / 2**20:+.1f})")
    if health.status_code != 200 or health.json().get("worker") != "alive":
        problems.append(f"/health after the run: {health.status_code} {health.text[:200]}")
    if ok.status_code != 200:
        problems.append(f"a plain request after the run: {ok.status_code} {ok.text[:200]}")
    if after - before >= RSS_LIMIT:
        problems.append(f"resident memory grew {(after - before) / 2**20:.1f} MiB (limit {RSS_LIMIT >> 20} MiB)")
    if "Traceback" in log:
        problems.append("the server log holds a traceback: " + log[log.index("Traceback") :][:500])
    for problem in problems[:20]:
        print("FAIL", problem)
    print("PASS" if not problems else f"FAIL: {len(problems)} problems")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
