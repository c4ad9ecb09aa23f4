"""The load generator: streaming requests to any OpenAI-compatible endpoint, timed chunk by chunk.

A level runs `num_requests` requests with `concurrency` of them in flight at all times (a closed loop: each
client sends its next request when the previous one ends), the way vLLM's and SGLang's benchmarks load a server.
Each request streams and asks for `stream_options.include_usage`, so its token count is the server's own
`usage.completion_tokens`; a server that sends no usage is counted by content chunks instead, which undercounts
when a chunk carries several tokens (the result says which count it used).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from draftsmith.data.sources import Conversation


@dataclass
class RequestResult:
    index: int
    prompt_id: str
    ok: bool
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    tokens_from: str = "usage"  # "usage" (the server's count) or "chunks" (content chunks, a lower bound)
    finish_reason: str | None = None
    ttft: float | None = None  # seconds from sending to the first content
    e2e: float = 0.0  # seconds from sending to the end of the stream
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between successive content chunks
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # scheme://host:port, without /v1
    model: str
    kind: str = "chat"  # "chat" -> /v1/chat/completions with messages; "completions" -> /v1/completions
    api_key: str | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def base_url(url: str) -> str:
    """http://host:port from any of http://host:port, .../v1, .../v1/chat/completions."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/v1"):
        url = url.removesuffix(suffix)
    return url


def payload(endpoint: Endpoint, prompt: Conversation, max_tokens: int, temperature: float, seed: int) -> dict:
    body: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.kind == "chat":
        body["messages"] = prompt.messages
    else:
        body["prompt"] = "\n\n".join(m["content"] for m in prompt.messages)
    return body


async def send(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    index: int,
    prompt: Conversation,
    max_tokens: int,
    temperature: float,
    seed: int,
) -> RequestResult:
    """One streamed request, timed; never raises for a server or network failure (that is a failed result)."""
    result = RequestResult(index=index, prompt_id=prompt.id, ok=False)
    body = payload(endpoint, prompt, max_tokens, temperature, seed)
    parts: list[str] = []
    chunks = 0
    usage: dict | None = None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", endpoint.base_url + endpoint.path, json=body, headers=endpoint.headers) as r:
            result.status = r.status_code
            if r.status_code >= 400:
                result.error = _error_message(r.status_code, await r.aread())
                return result
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return result
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = _content(choice)
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    if text:
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.chunk_gaps.append(now - last)
                        last = now
                        chunks += 1
                        parts.append(text)
            if not done:
                result.error = "the stream ended without [DONE]"
                return result
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        result.e2e = time.perf_counter() - start
    result.text = "".join(parts)
    if usage and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage.get("prompt_tokens")
    else:
        result.output_tokens, result.tokens_from = chunks, "chunks"
    result.ok = True
    return result


async def run_level(
    endpoint: Endpoint,
    prompts: list[Conversation],
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """(results in request order, wall seconds from the first send to the last answer)."""
    pending = iter(range(num_requests))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:

        async def worker() -> None:
            for i in pending:  # a shared iterator: each index is taken by exactly one worker
                prompt = prompts[i % len(prompts)]
                results.append(await send(client, endpoint, i, prompt, max_tokens, temperature, seed + i))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return sorted(results, key=lambda r: r.index), wall


def _content(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = body[:200].decode(errors="replace")
    return f"HTTP {status}: {message}"
