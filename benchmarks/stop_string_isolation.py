"""Does one hostile client slow the others? Inter-token latency of a victim, alone and beside a client that sends
16 stop strings of 60 KB each.

One `draftsmith serve` (--target, the n-gram drafter). A victim client streams --victim-requests chat requests,
one after another, and records the time between consecutive streamed chunks (inter-token latency). Rounds
alternate: A, the victim alone; B, the victim while a hostile client keeps sending, on --hostile-clients
connections, chat requests carrying --stop-count stop strings of --stop-chars characters each (default 16 x 60 KB:
refused with a 400 by the length cap, so B measures what parsing and refusing them costs the server), plus, with
--at-cap, the longest stop strings the server accepts (which it must match while decoding). The rounds interleave
A B B A ... so drift on the machine hits both alike. It prints the victim's median ITL for A and B and B / A.

Must hold (issue 13): B / A < 1.20, on a quiet machine:

    PYTHONPATH=src .venv/bin/python benchmarks/stop_string_isolation.py [--target smollm2-135m] [--rounds 6]
        [--victim-requests 8] [--max-tokens 64] [--threads 1] [--at-cap]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from draftsmith.serve.process import ServerProcess
from draftsmith.serve.protocol import MAX_STOP_CHARS

VICTIM_PROMPTS = ["Explain how a bicycle stays upright.", "Write a short poem about rain.",
                  "List three uses of a paperclip.", "What is the capital of France and why?"]  # fmt: skip


async def victim(url: str, n: int, max_tokens: int) -> list[float]:
    """Inter-token latencies (seconds) of `n` streamed greedy chats, one at a time."""
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in range(n):
            prompt = VICTIM_PROMPTS[i % len(VICTIM_PROMPTS)]
            body = {"model": "target", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True}  # fmt: skip
            last = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
    return gaps


async def hostile(url: str, stops: list[list[str]], max_tokens: int, until: asyncio.Event, counts: dict) -> None:
    """Requests one after another, as fast as they are answered, taking each stop-string set in turn."""
    ask = [{"role": "user", "content": "Tell me a long story."}]
    request = {"model": "target", "messages": ask, "max_tokens": max_tokens, "temperature": 0}
    bodies = [json.dumps(request | {"stop": stop}).encode() for stop in stops]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in itertools.count():
            if until.is_set():
                return
            r = await client.post("/v1/chat/completions", content=bodies[i % len(bodies)],
                                  headers={"content-type": "application/json"})  # fmt: skip
            counts[r.status_code] = counts.get(r.status_code, 0) + 1


async def round_b(url: str, args, stops: list[list[str]], counts: dict) -> list[float]:
    until = asyncio.Event()
    attackers = [asyncio.create_task(hostile(url, stops, args.max_tokens, until, counts))
                 for _ in range(args.hostile_clients)]  # fmt: skip
    await asyncio.sleep(0.5)  # the attack is under way before the victim starts
    try:
        return await victim(url, args.victim_requests, args.max_tokens)
    finally:
        until.set()
        await asyncio.gather(*attackers, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each of A and B, interleaved")
    parser.add_argument("--victim-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stop-count", type=int, default=16)
    parser.add_argument("--stop-chars", type=int, default=60_000)
    parser.add_argument("--hostile-clients", type=int, default=1)
    parser.add_argument("--at-cap", action="store_true", help="also send accepted stop strings of the maximum length")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--refusal-hold", type=float, default=None, help="serve's --refusal-hold (0: no hold)")
    args = parser.parse_args(argv)
    # ASCII stop strings (16 x 60 KB fit the 1 MiB body limit) that never occur in an answer, so a hostile
    # request that is accepted decodes to max_tokens, matching its stops after every token.
    stops = [[f"{i:02d}" + "~" * (args.stop_chars - 2) for i in range(args.stop_count)]]
    if args.at_cap:
        stops.append([f"{i:02d}" + "~" * (MAX_STOP_CHARS - 2) for i in range(args.stop_count)])
    serve_args = ["--target", args.target, "--drafter", "ngram", "--model-name", "target", "--max-active", "4"]
    if args.threads:
        serve_args += ["--threads", str(args.threads)]
    if args.refusal_hold is not None:
        serve_args += ["--refusal-hold", str(args.refusal_hold)]
    a_gaps: list[float] = []
    b_gaps: list[float] = []
    counts: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(serve_args, log=Path(tmp) / "server.log") as server:
        asyncio.run(victim(server.url, 2, 16))  # warm-up
        for r in range(args.rounds):
            for which in "AB" if r % 2 == 0 else "BA":
                if which == "A":
                    a_gaps += asyncio.run(victim(server.url, args.victim_requests, args.max_tokens))
                else:
                    b_gaps += asyncio.run(round_b(server.url, args, stops, counts))
    a, b = statistics.median(a_gaps), statistics.median(b_gaps)
    print(f"victim median inter-token latency: alone {a * 1e3:.2f} ms, beside the hostile client {b * 1e3:.2f} ms")
    print(f"B / A = {b / a:.3f} (must hold: < 1.20); hostile responses by status: {dict(sorted(counts.items()))}")
    return 0 if b / a < 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
