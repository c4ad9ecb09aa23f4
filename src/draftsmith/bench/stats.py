"""Turn one level's request results into the numbers a report shows: rates, latencies and their percentiles."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from draftsmith.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation, as numpy and vLLM's benchmark compute them), times `scale`."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float) * scale
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarise_level(
    concurrency: int, results: list[RequestResult], wall: float, server: dict[str, Any] | None
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    errors = Counter(r.error for r in results if not r.ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_messages": dict(errors.most_common(5)),
        "duration_s": wall,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "tokens_counted_from": sorted({r.tokens_from for r in ok}),
        "output_tokens_per_s": output_tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], 1e3),
        "itl_ms": distribution([g for r in ok for g in r.chunk_gaps], 1e3),
        "tpot_ms": distribution(tpot, 1e3),
        "e2e_ms": distribution([r.e2e for r in ok], 1e3),
        "request_tokens_per_s": distribution([r.output_tokens / r.e2e for r in ok if r.e2e > 0]),
        "server": server,
        "per_request": [r.to_json() for r in results],
    }
