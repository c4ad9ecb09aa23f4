"""`draftsmith bench`: load an OpenAI-compatible endpoint at each concurrency level and report what it did.

Before the levels, one warm-up request (not counted) checks that the endpoint answers and wakes it up. Around each
level the server's /metrics is scraped, so the report shows the server's own token count (and, for draftsmith,
its acceptance length) next to the client's.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field, field_validator

from draftsmith.bench.client import Endpoint, base_url, run_level, send
from draftsmith.bench.server_stats import level_delta, scrape
from draftsmith.bench.stats import summarise_level
from draftsmith.config import StageConfig
from draftsmith.data.sources import Conversation, load_eval_prompts
from draftsmith.errors import DraftsmithError


class BenchConfig(StageConfig):
    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    concurrency: list[int] = Field(default=[1, 2, 4, 8], min_length=1)
    prompts: str = "builtin"
    data_dir: Path | None = None
    num_prompts: int = Field(default=16, ge=1)
    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    endpoint: str = Field(default="chat", pattern="^(chat|completions)$")
    seed: int = 0
    timeout: float = Field(default=600.0, gt=0)
    out: Path = Path("runs/bench")

    @field_validator("concurrency", mode="before")
    @classmethod
    def _levels(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = [int(x) for x in value.split(",") if x.strip()]
            except ValueError:
                raise ValueError("expected comma-separated integers, e.g. 1,2,4,8") from None
        if isinstance(value, list) and any(not isinstance(c, int) or c < 1 for c in value):
            raise ValueError("every concurrency level must be a positive integer")
        return value


def run_bench(cfg: BenchConfig, log=print) -> dict[str, Any]:
    """Run every level; returns the result (see README: `draftsmith bench`). Writes nothing; see report.py."""
    dataset, prompts = load_eval_prompts(cfg.prompts, cfg.data_dir, cfg.num_prompts)
    return asyncio.run(_run(cfg, dataset, prompts, log))


async def _run(cfg: BenchConfig, dataset: str, prompts: list[Conversation], log) -> dict[str, Any]:
    base = base_url(cfg.url)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout)) as client:
        model = cfg.model or await _first_model(client, base)
        endpoint = Endpoint(base, model, cfg.endpoint, os.environ.get("OPENAI_API_KEY"))
        warm = await send(client, endpoint, -1, prompts[0], min(cfg.max_tokens, 16), cfg.temperature, cfg.seed)
        if not warm.ok:
            raise DraftsmithError(
                f"the warm-up request to {base}{endpoint.path} failed: {warm.error}",
                hint="check --url, --model and --endpoint (chat or completions), and that the server is up",
            )
        levels = []
        for concurrency in cfg.concurrency:
            before = await scrape(client, base)
            results, wall = await run_level(
                endpoint, prompts, concurrency, cfg.num_prompts, cfg.max_tokens, cfg.temperature, cfg.seed, cfg.timeout
            )
            after = await scrape(client, base)
            level = summarise_level(concurrency, results, wall, level_delta(before, after))
            levels.append(level)
            log(
                f"concurrency {concurrency}: {level['completed']}/{level['requests']} ok, "
                f"{level['output_tokens_per_s']:.1f} output tok/s, {wall:.1f} s"
            )
    return {
        "url": base,
        "model": model,
        "endpoint": cfg.endpoint,
        "prompts": dataset,
        "num_requests": cfg.num_prompts,
        "distinct_prompts": len(prompts),
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": levels,
    }


async def _first_model(client: httpx.AsyncClient, base: str) -> str:
    """The endpoint's first model id, from GET /v1/models."""
    hint = "check --url, or pass --model explicitly"
    try:
        r = await client.get(base + "/v1/models", timeout=30.0)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except httpx.HTTPError as exc:
        raise DraftsmithError(f"cannot list the models at {base}/v1/models: {exc}", hint=hint) from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise DraftsmithError(f"{base}/v1/models did not return an OpenAI model list", hint=hint) from None
