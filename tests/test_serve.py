"""`draftsmith serve` as users run it: a real server process on a loopback port, driven by a real HTTP client.

One server (a tiny random Llama saved to disk, the n-gram drafter, 2 decode slots and a queue of 6) serves every
test in this module, so the tests also check that it keeps serving after each of them.
"""

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from draftsmith.bench.server_stats import parse_prometheus
from draftsmith.cli import app
from draftsmith.config import EvalConfig
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.budget import DraftBudget, linear_costs
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.evaluate import baseline_generate
from draftsmith.serve.metrics import ServerMetrics
from draftsmith.serve.process import ServerProcess
from draftsmith.serve.protocol import MAX_STOP_CHARS
from draftsmith.serve.scheduler import GenerationRequest, Scheduler, fork_drafter
from draftsmith.serve.text import TextStream
from draftsmith.target import load_target
from tests.conftest import tiny_target
from tests.test_eagle3 import make_model

CONTEXT = 512
SLOTS, QUEUE = 2, 6
LONG_PROMPT = "t9 t9 t9 t9"  # on this model, greedy decoding from it runs 440+ tokens without an EOS
PROMPTS = ["t5 t6 t7", "t11 t12", "t20 t30 t40 t50", "t40 t41 t42 t43 t44 t45", LONG_PROMPT]  # EOS after 10/35/110/1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    target = tiny_target(0)
    target.model.config.max_position_embeddings = CONTEXT
    path = tmp_path_factory.mktemp("serve") / "model"
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--target", str(model_dir), "--drafter", "ngram", "--num-draft-tokens", "4", "--threads", "1",
            "--max-active", str(SLOTS), "--max-queue", str(QUEUE), "--model-name", "tiny",
            "--refusal-hold", "0"]  # fmt: skip  # these tests send many bad requests on purpose
    with ServerProcess(args, log=model_dir.parent / "server.log", env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: -15 is its normal exit code.
    assert proc.proc.returncode in (0, -15) and not any("Traceback" in line for line in proc.lines), proc.lines


def chat(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def stream_text(client: httpx.Client, path: str, body: dict) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, usage) of a streamed request, read as a client would."""
    parts, finish, usage = [], None, None
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            parts.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
            finish = choice["finish_reason"] or finish
    return "".join(parts), finish, usage


def metrics(client: httpx.Client) -> dict[str, float]:
    return parse_prometheus(client.get("/metrics").text)


def counter(client: httpx.Client, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if want else f"{name} "):
            return float(line.split()[-1])
    return 0.0


def test_models_health_and_metrics_format(server):
    with httpx.Client(base_url=server.url) as client:
        assert client.get("/health").json()["status"] == "ok"
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
        assert models["data"][0]["max_model_len"] == CONTEXT
        r = client.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text
    for name in ("draftsmith_queue_depth", "draftsmith_generation_tokens_total", "draftsmith_acceptance_length"):
        assert f"# TYPE {name} " in text
    buckets = [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("draftsmith_acceptance_length_bucket")
    ]
    assert buckets == sorted(buckets) and len(buckets) == 4 + 2  # le=1..k+1 and +Inf, cumulative
    assert 'le="+Inf"' in text and "process_resident_memory_bytes" in text


def test_stream_and_plain_are_identical_and_equal_offline_eval(server, model_dir, tmp_path):
    n = 40
    served = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for prompt in PROMPTS:
            body = chat(prompt, max_tokens=n, temperature=0, seed=7)
            plain = client.post("/v1/chat/completions", json=body).json()
            text, finish, usage = stream_text(client, "/v1/chat/completions", body)
            assert text == plain["choices"][0]["message"]["content"]
            assert finish == plain["choices"][0]["finish_reason"] and usage == plain["usage"]
            served.append(plain)
            # The same on /v1/completions, and with sampling: one seed, one answer, streamed or not.
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.9, "seed": 3}
            plain_completion = client.post("/v1/completions", json=body).json()
            assert stream_text(client, "/v1/completions", body)[0] == plain_completion["choices"][0]["text"]

    # Offline: the engine and model.generate, exactly as `draftsmith eval` runs them, on the same saved model.
    target = load_target(str(model_dir))
    cfg = EvalConfig(max_new_tokens=n)
    for prompt, reply in zip(PROMPTS, served, strict=True):
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": prompt}])
        spec = SpeculativeDecoder(target, NgramDrafter(), 4).generate(ids, n).tokens
        base, _ = baseline_generate(target, ids, cfg, seed=0)
        assert spec == base
        assert reply["choices"][0]["message"]["content"] == target.tokenizer.decode(spec, skip_special_tokens=True)
        assert reply["usage"]["completion_tokens"] == len(spec) and reply["usage"]["prompt_tokens"] == len(ids)
        expected = "stop" if spec[-1] in target.eos_token_ids else "length"
        assert reply["choices"][0]["finish_reason"] == expected
    assert {r["choices"][0]["finish_reason"] for r in served} == {"stop", "length"}
    with httpx.Client(base_url=server.url) as client:
        m = metrics(client)  # drafts were accepted: some rounds carried several tokens, and still all is equal
    assert m["draftsmith_acceptance_length_sum"] > m["draftsmith_acceptance_length_count"]
    assert served[3]["choices"][0]["message"]["content"] == "" and served[3]["usage"]["completion_tokens"] == 1

    # And `draftsmith eval` itself on these prompts: no mismatch, the same token counts.
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    result = CliRunner().invoke(app, ["eval", "--target", str(model_dir), "--drafter", "ngram", "--dataset",
                                      str(prompts_file), "--max-new-tokens", str(n), "--num-draft-tokens", "4",
                                      "--out", str(tmp_path / "eval")])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["mismatches"] == 0
    assert [p["new_tokens"] for p in report["per_prompt"]] == [r["usage"]["completion_tokens"] for r in served]


def test_stop_strings_cut_the_text_the_same_way_streamed_or_not(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        full = client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 30, "temperature": 0})
        text = full.json()["choices"][0]["text"]
        stop = text.split()[5]  # a word from the middle: the answer must end right before its first occurrence
        body = {"prompt": LONG_PROMPT, "max_tokens": 30, "temperature": 0, "stop": [stop, "never-there"]}
        plain = client.post("/v1/completions", json=body).json()
        streamed, finish, _ = stream_text(client, "/v1/completions", body)
    assert plain["choices"][0]["text"] == streamed == text[: text.index(stop)]
    assert plain["choices"][0]["finish_reason"] == finish == "stop"


LONG = "t9 " * 600
BAD_REQUESTS = [
    # (name, path, raw body, status, error param or None)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("max_tokens as string", "/v1/completions", {"prompt": "t5", "max_tokens": "10"}, 400, "max_tokens"),
    ("temperature as string", "/v1/completions", {"prompt": "t5", "temperature": "hot"}, 400, "temperature"),
    ("stream as string", "/v1/chat/completions", chat("t5", stream="yes"), 400, "stream"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    (
        "content a number",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
    ),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages.0.role"),
    ("no messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("max_tokens 0", "/v1/completions", {"prompt": "t5", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions", chat("t5", max_tokens=-3), 400, "max_tokens"),
    ("max_tokens beyond context", "/v1/completions", {"prompt": "t5", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("prompt longer than context", "/v1/chat/completions", chat(LONG, max_tokens=4), 400, "messages"),
    ("prompt ids longer than context", "/v1/completions", {"prompt": [5] * CONTEXT}, 400, "prompt"),
    ("unknown model", "/v1/chat/completions", chat("t5", model="gpt-4o"), 404, "model"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"prompt": [5, 10_000]}, 400, None),
    ("batched prompts", "/v1/completions", {"prompt": ["t5", "t6"]}, 400, "prompt"),
    ("n > 1", "/v1/completions", {"prompt": "t5", "n": 2}, 400, "n"),
    ("top_p 0", "/v1/completions", {"prompt": "t5", "top_p": 0}, 400, "top_p"),
    ("seed too large", "/v1/completions", {"prompt": "t5", "seed": 2**70}, 400, "seed"),
    ("stop of numbers", "/v1/completions", {"prompt": "t5", "stop": [1]}, 400, "stop"),
    ("body too large", "/v1/completions", {"prompt": "t5 " * 400_000}, 413, None),
    ("nested 100000 deep", "/v1/completions", b"[" * 100_000, 400, None),
    ("lone surrogate", "/v1/completions", b'{"prompt": "t5 \\udcff"}', 400, None),
    ("nested 5000 deep", "/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("nested 500 deep", "/v1/chat/completions", b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}", 400, None),
    ("stop string too long", "/v1/completions", {"prompt": "t5", "stop": ["x" * (MAX_STOP_CHARS + 1)]}, 400, "stop"),
    (
        "too many messages",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "t5"}] * 1025},
        400,
        "messages",
    ),  # fmt: skip
    ("prompt characters over the cap", "/v1/completions", {"prompt": " " * (CONTEXT * 16 + 1)}, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, name, path, body, status, param):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
        if param is not None:
            assert error["param"] == param, error
        ok = client.post("/v1/completions", json={"prompt": "t5 t6", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_wrong_method_and_unknown_path_are_openai_errors(server):
    with httpx.Client(base_url=server.url) as client:
        for r, status in ((client.get("/v1/completions"), 405), (client.post("/v1/nothing", json={}), 404)):
            assert r.status_code == status and r.json()["error"]["message"]


def test_overload_answers_429_with_retry_after_and_recovers(server):
    """Fill every slot and queue place with long streams, then ask for more: 429 + Retry-After, never a 5xx."""

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            long = chat(LONG_PROMPT, max_tokens=80, temperature=0, stream=True)
            streams = [client.stream("POST", "/v1/chat/completions", json=long) for _ in range(SLOTS + QUEUE)]
            responses = [await s.__aenter__() for s in streams]  # headers are sent at admission
            assert [r.status_code for r in responses] == [200] * (SLOTS + QUEUE)
            extra = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat("t5")) for _ in range(3)))
            for r in extra:
                assert r.status_code == 429, r.text
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "overloaded"
            bodies = [await r.aread() for r in responses]  # the admitted ones all finish normally
            for s in streams:
                await s.__aexit__(None, None, None)
            assert all(b.rstrip().endswith(b"data: [DONE]") for b in bodies)
            after = await client.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2, "temperature": 0})
            assert after.status_code == 200

    with httpx.Client(base_url=server.url) as client:
        rejected = counter(client, "draftsmith_requests_rejected_total")
        asyncio.run(scenario())
        assert counter(client, "draftsmith_requests_rejected_total") == rejected + 3
        assert counter(client, "draftsmith_queue_depth") == 0


def test_client_disconnect_mid_stream_frees_its_slot(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        cancelled = counter(client, "draftsmith_requests_finished_total", reason="cancelled")
        tokens = counter(client, "draftsmith_generation_tokens_total")
        body = chat(LONG_PROMPT, max_tokens=440, temperature=0, stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if '"content": "t' in line:  # the first real token: the request is decoding
                    break
        # Leaving the block closed the connection; the worker notices before its next round for this request.
        for _ in range(100):
            if counter(client, "draftsmith_requests_finished_total", reason="cancelled") == cancelled + 1:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert counter(client, "draftsmith_requests_finished_total", reason="cancelled") == cancelled + 1
        assert counter(client, "draftsmith_active_requests") == 0
        assert counter(client, "draftsmith_generation_tokens_total") - tokens < 440  # stopped early

        # A non-streaming client that gives up (here: a read timeout) frees its slot too.
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json={**body, "stream": False}, timeout=0.3)
        for _ in range(100):
            if counter(client, "draftsmith_requests_finished_total", reason="cancelled") == cancelled + 2:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert counter(client, "draftsmith_requests_finished_total", reason="cancelled") == cancelled + 2
        assert counter(client, "draftsmith_active_requests") == 0
        ok = client.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


MALFORMED = [
    b'{"messages": [{"role": "user", "content": "t5"}',
    json.dumps({"messages": [{"role": "user", "content": "t5"}], "max_tokens": 0}).encode(),
    json.dumps({"prompt": "t5", "max_tokens": "many"}).encode(),
    json.dumps({"prompt": "t5", "model": "other"}).encode(),
    json.dumps({"prompt": LONG}).encode(),
]
RSS_MARGIN = 16 * 2**20  # the server may grow this much over 200 requests (measured: under 1 MiB)


def resident(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_200_requests_at_concurrency_8_with_malformed_ones(server):
    """Every 10th request is malformed: each of those gets a 4xx, every valid one completes, no 5xx, flat memory."""

    def request(i: int) -> tuple[str, bytes, bool, bool]:
        if i % 10 == 9:
            return "/v1/chat/completions" if i % 20 == 9 else "/v1/completions", MALFORMED[i % 5], False, False
        stream = i % 3 == 0
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.7, "seed": i}
            return "/v1/completions", json.dumps({**body, "stream": stream}).encode(), True, stream
        return "/v1/chat/completions", json.dumps(chat(prompt, max_tokens=8, stream=stream)).encode(), True, stream

    async def run(n: int) -> list[tuple[bool, int, bytes]]:
        todo = iter(range(n))
        out: list[tuple[bool, int, bytes]] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

            async def worker() -> None:
                for i in todo:
                    path, body, valid, _ = request(i)
                    r = await client.post(path, content=body, headers={"content-type": "application/json"})
                    out.append((valid, r.status_code, r.content))

            await asyncio.gather(*(worker() for _ in range(8)))
        return out

    asyncio.run(run(20))  # warm-up: the allocator and the tokenizer reach their steady state
    with httpx.Client(base_url=server.url) as client:
        before_metrics = metrics(client)
    before = resident(server.pid)
    results = asyncio.run(run(200))
    after = resident(server.pid)
    with httpx.Client(base_url=server.url) as client:
        after_metrics = metrics(client)

    valid = [(s, b) for v, s, b in results if v]
    malformed = [(s, b) for v, s, b in results if not v]
    assert len(valid) == 180 and len(malformed) == 20
    assert all(s == 200 for s, _ in valid), [s for s, _ in valid]
    assert all(b.rstrip().endswith(b"[DONE]") or b'"finish_reason"' in b for _, b in valid)
    assert all(400 <= s < 500 for s, _ in malformed), [s for s, _ in malformed]
    assert not [s for _, s, _ in results if s >= 500]

    def finished(m: dict[str, float]) -> float:
        return m["draftsmith_requests_finished_total"]

    assert finished(after_metrics) - finished(before_metrics) == 180
    assert after_metrics["draftsmith_queue_depth"] == after_metrics["draftsmith_active_requests"] == 0
    print(f"resident memory: {before / 2**20:.1f} MiB before, {after / 2**20:.1f} MiB after 200 requests")
    assert after - before < RSS_MARGIN, f"resident memory grew {(after - before) / 2**20:.1f} MiB"


@pytest.mark.integration
def test_text_stream_never_splits_a_character_and_holds_back_stop_prefixes(smollm2):
    """SmolLM2's byte-level BPE splits these characters over several tokens; fed one token at a time, no delta may
    carry half a character (U+FFFD), the deltas must add up to the whole decode, and a stop string is cut."""
    tokenizer = smollm2.tokenizer
    text = "Good morning: おはよう, 早上好, Доброе утро 🌅! Then STOP here."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # several tokens per word: characters really are split

    stream = TextStream(tokenizer)
    deltas = [stream.push([t]) for t in ids] + [stream.finish()]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text

    stream = TextStream(tokenizer, stop=["STOP", "never"])
    deltas = []
    for t in ids:
        deltas.append(stream.push([t]))
        assert "S" not in "".join(deltas)  # "S" might start "STOP": held back until it cannot
        if stream.stopped:
            break
    deltas.append(stream.finish())
    assert stream.stopped and "".join(deltas) == text[: text.index("STOP")]


@pytest.mark.parametrize(
    "kind", ["ngram", "eagle3", "ngram-tree", "eagle3-tree", "eagle3-budgeted-tree", "eagle3+ngram-budgeted-tree"]
)
def test_interleaved_requests_decode_exactly_as_one_at_a_time(kind):
    """The scheduler interleaves requests round by round, each with its own copy of the drafter: every answer, greedy
    or sampled, must be the one the engine gives for that request alone (trees included, and the EAGLE-3 cpu
    profiles' default policy: the learned tree and n-gram as one tree)."""
    from draftsmith.decode.tree import TreeShape
    from draftsmith.drafters import with_tree
    from draftsmith.drafters.merged import MergedDrafter

    target = tiny_target(3)
    # budgeted: trees cut where they stop paying, at cheap rows (a random drafter pays for little else)
    budget = DraftBudget(linear_costs(1.0, 0.01), step_cost=0.01) if "budgeted" in kind else DraftBudget.fixed()
    drafter = (
        NgramDrafter(budget=budget) if kind.startswith("ngram") else Eagle3Drafter(make_model(target), budget=budget)
    )
    if kind.startswith("eagle3+ngram"):
        drafter = MergedDrafter([drafter, NgramDrafter(budget=DraftBudget(linear_costs(1.0, 0.01), step_cost=0.0))])
    drafter = with_tree(drafter, TreeShape(3, 2, 4) if kind.endswith("tree") else None)
    metrics = ServerMetrics(4, target="tiny", drafter=kind, model="tiny")
    scheduler = Scheduler(target, drafter, metrics, num_draft_tokens=4, max_active=3, max_queue=8)
    prompts = ["t5 t6 t7", "t9 t9 t9 t9", "t20 t30 t40 t50", "t11 t12", "t40 t41 t42"]
    requests = [
        GenerationRequest(
            encode_chat(target.tokenizer, [{"role": "user", "content": p}]), 30, temperature=0.8 * (i % 2), seed=i
        )
        for i, p in enumerate(prompts)
    ]

    async def serve_all() -> list[tuple[str, int]]:
        jobs = [scheduler.submit(r) for r in requests]
        answers = []
        for job in jobs:
            text, tokens = "", 0
            while True:
                event = await job.events.get()
                assert event.error is None
                text, tokens = text + event.text, tokens + event.tokens
                if event.finish_reason:
                    break
            answers.append((text, tokens))
        return answers

    scheduler.start()
    try:
        answers = asyncio.run(serve_all())
    finally:
        scheduler.stop()
    total = 0
    for req, (text, tokens) in zip(requests, answers, strict=True):
        alone = SpeculativeDecoder(target, fork_drafter(drafter), 4)
        expected = alone.generate(req.prompt_ids, req.max_tokens, req.temperature, req.top_p, req.seed).tokens
        assert tokens == len(expected) and text == target.tokenizer.decode(expected, skip_special_tokens=True)
        total += tokens
    assert metrics.generation_tokens.get() == metrics.acceptance.sum == total
    assert metrics.acceptance.sum > metrics.acceptance.count  # drafts were accepted
    assert metrics.finished.get(reason="stop") + metrics.finished.get(reason="length") == len(requests)


def test_a_local_server_that_web_pages_cannot_drive(server, model_dir):
    """Form and text/plain posts (sent cross-site without a preflight) get 415, a DNS-rebinding Host gets 421, and
    no answer or metric names a local path or quotes an exception."""
    body = json.dumps({"prompt": "t5", "max_tokens": 2}).encode()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            r = client.post("/v1/completions", content=body, headers={"content-type": kind} if kind else {})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (kind, r.text)
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            r = client.post("/v1/completions", content=body, headers={"content-type": "application/json", "host": host})
            assert r.status_code in (400, 421) and "error" in r.json(), (host, r.text)
            assert client.get("/health", headers={"host": host}).status_code in (400, 421)
        port = server.url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            assert client.post("/v1/completions", content=body, headers={"content-type": "application/json",
                                                                         "host": host}).status_code == 200  # fmt: skip
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["worker"] == "alive"
        text = client.get("/metrics").text
    assert str(model_dir) not in text and 'target="model"' in text


def test_api_key_guards_every_v1_route():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from draftsmith.serve.app import _Guard

    async def ok(request):
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route("/v1/models", ok), Route("/v1/chat/completions", ok, methods=["POST"]),
                              Route("/health", ok)])  # fmt: skip
    guarded = _Guard(inner, allowed_hosts=frozenset({"127.0.0.1"}), api_key="s3cret")

    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return [
                (await client.get("/v1/models")).status_code,
                (await client.get("/v1/models", headers={"authorization": "Bearer wrong"})).status_code,
                (await client.post("/v1/chat/completions", headers={"authorization": "Basic s3cret"})).status_code,
                (await client.get("/v1/models", headers={"authorization": "Bearer s3cret"})).status_code,
                (await client.get("/health")).status_code,  # not a /v1 route: for load balancers
                (await client.get("/health", headers={"host": "evil.example"})).status_code,
            ]

    assert asyncio.run(scenario()) == [401, 401, 401, 200, 200, 421]


def test_a_dead_scheduler_thread_fails_its_requests_and_health_says_so():
    target = tiny_target(3)
    metrics = ServerMetrics(4, target="tiny", drafter="ngram", model="tiny")
    scheduler = Scheduler(target, NgramDrafter(), metrics, num_draft_tokens=4, max_active=2, max_queue=4)
    calls = []

    def breaks_on_second_call(active: int) -> None:
        calls.append(active)
        if len(calls) > 1:
            raise RuntimeError("/secret/path bug")

    scheduler._publish = breaks_on_second_call

    async def scenario() -> str | None:
        job = scheduler.submit(
            GenerationRequest(encode_chat(target.tokenizer, [{"role": "user", "content": "t5"}]), 20)
        )
        return (await asyncio.wait_for(job.events.get(), 30)).error

    scheduler.start()
    try:
        error = asyncio.run(scenario())
    finally:
        scheduler.stop()
    assert error and "secret" not in error and not scheduler.alive()
    with pytest.raises(Exception, match="worker"):
        raise_if_dead(scheduler)


def raise_if_dead(scheduler: Scheduler) -> None:
    from draftsmith.serve.scheduler import WorkerDead

    try:
        scheduler.check_capacity()
    except WorkerDead:
        raise RuntimeError("the worker is dead") from None


def test_stop_strings_are_matched_only_in_the_tail_and_cut_like_a_full_search():
    """The incremental search finds the same cut as searching the whole text, for stops spanning pushes."""
    tokenizer = tiny_target(0).tokenizer
    words = [f"t{i % 7 + 2}" for i in range(300)]
    ids = tokenizer(" ".join(words))["input_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for stop in (["t5 t6 t7"], ["t8 t2 t3 t4", "zzz"], ["t" + "x" * 50], [text[-40:]]):
        stream = TextStream(tokenizer, stop)
        out = "".join(stream.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + stream.finish()
        hits = [text.find(s) for s in stop if s in text]
        assert out == (text[: min(hits)] if hits else text), stop


def test_a_body_that_trickles_in_gets_408():
    from starlette.requests import Request

    from draftsmith.serve.app import _read_json
    from draftsmith.serve.protocol import APIError

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b" ", "more_body": True}  # one byte at a time, forever

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip

    async def scenario() -> int:
        try:
            await _read_json(Request(scope, receive), 1 << 20, 0.3)
        except APIError as exc:
            return exc.status
        return 200

    assert asyncio.run(scenario()) == 408
