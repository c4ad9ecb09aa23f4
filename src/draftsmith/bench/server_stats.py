"""What the server itself counted during a level, read from its Prometheus /metrics before and after.

Only counters matter here (tokens generated, target forwards), so a level's figure is the difference of two
scrapes. draftsmith, vLLM and SGLang name their generated-token counter differently; the first one found is used.
A server without /metrics simply has no server figures.
"""

from __future__ import annotations

from typing import Any

import httpx

GENERATION_TOKENS = (
    "draftsmith_generation_tokens_total",
    "vllm:generation_tokens_total",
    "sglang:generation_tokens_total",
)
PROMPT_TOKENS = ("draftsmith_prompt_tokens_total", "vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
FORWARDS = ("draftsmith_target_forwards_total",)


def parse_prometheus(text: str) -> dict[str, float]:
    """{series name: value summed over its label sets} from the Prometheus text format; histogram buckets skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            head, _, tail = line.rpartition("}")
            name = head.split("{", 1)[0]
        else:
            name, _, tail = line.partition(" ")
        fields = tail.split()
        if not fields or name.endswith("_bucket"):
            continue
        try:
            totals[name] = totals.get(name, 0.0) + float(fields[0])
        except ValueError:
            continue
    return totals


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    try:
        r = await client.get(base_url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return parse_prometheus(r.text) if r.status_code == 200 else None


def level_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The server's own counts for one level, or None when it exposes none we know."""
    if before is None or after is None:
        return None

    def delta(names: tuple[str, ...]) -> float | None:
        name = next((n for n in names if n in after), None)
        return None if name is None else after[name] - before.get(name, 0.0)

    tokens, prompt, forwards = delta(GENERATION_TOKENS), delta(PROMPT_TOKENS), delta(FORWARDS)
    if tokens is None:
        return None
    return {
        "generation_tokens": int(tokens),
        "prompt_tokens": None if prompt is None else int(prompt),
        "target_forwards": None if forwards is None else int(forwards),
        "acceptance_length": tokens / forwards if forwards else None,
    }
