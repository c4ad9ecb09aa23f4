"""`draftsmith bench`: its statistics and comparison, and a real run against a real `draftsmith serve` process."""

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from draftsmith.bench.client import base_url
from draftsmith.bench.compare import compare
from draftsmith.bench.server_stats import level_delta, parse_prometheus
from draftsmith.bench.stats import distribution
from draftsmith.cli import app
from draftsmith.serve.process import ServerProcess
from tests.conftest import tiny_target


def test_distribution_matches_numpy_percentiles():
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    d = distribution(values, scale=1e3)
    assert d["p50"] == pytest.approx(np.percentile(values, 50) * 1e3)
    assert d["p99"] == pytest.approx(np.percentile(values, 99) * 1e3)
    assert d["mean"] == pytest.approx(np.mean(values) * 1e3)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_prometheus_parsing_sums_label_sets_and_skips_buckets():
    text = """# HELP x_total things
# TYPE x_total counter
x_total{code="200"} 7
x_total{code="400",path="/a b"} 3
plain 2.5
h_bucket{le="1"} 4
h_bucket{le="+Inf"} 9
h_sum 12
vllm:generation_tokens_total{model_name="m"} 40
"""
    parsed = parse_prometheus(text)
    assert parsed == {"x_total": 10.0, "plain": 2.5, "h_sum": 12.0, "vllm:generation_tokens_total": 40.0}
    before = {"draftsmith_generation_tokens_total": 10.0, "draftsmith_target_forwards_total": 5.0}
    after = {"draftsmith_generation_tokens_total": 40.0, "draftsmith_target_forwards_total": 20.0}
    assert level_delta(before, after) == {
        "generation_tokens": 30,
        "prompt_tokens": None,
        "target_forwards": 15,
        "acceptance_length": 2.0,
    }
    assert level_delta(None, after) is None and level_delta({}, {"other": 1.0}) is None


def test_base_url_accepts_any_openai_url_form():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert base_url(url) == "http://h:1"


def level(concurrency: int, tps: float, ttft: float) -> dict:
    stats = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
    return {"concurrency": concurrency, "output_tokens_per_s": tps, "ttft_ms": stats, "tpot_ms": stats,
            "e2e_ms": stats}  # fmt: skip


def test_compare_gives_b_over_a_per_shared_level(tmp_path):
    a = {"levels": [level(1, 10.0, 100.0), level(2, 16.0, 200.0), level(4, 20.0, 400.0)]}
    b = {"levels": [level(1, 15.0, 50.0), level(4, 18.0, 600.0), level(8, 30.0, 900.0)]}
    rows = compare(a, b)
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert rows[0]["output tok/s"] == pytest.approx(1.5) and rows[0]["TTFT p50"] == pytest.approx(0.5)
    assert rows[1]["output tok/s"] == pytest.approx(0.9) and rows[1]["e2e p99"] == pytest.approx(1.5)

    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    result = CliRunner().invoke(app, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    assert "1.50x" in result.output and "0.90x" in result.output
    result = CliRunner().invoke(app, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "none.json" in result.output


def test_bench_refuses_bad_options_and_unreachable_servers():
    result = CliRunner().invoke(app, ["bench", "--concurrency", "1,two"])
    assert result.exit_code == 2 and "concurrency" in result.output
    result = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert result.exit_code == 2 and "cannot list the models" in result.output and "hint" in result.output


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Plain decoding (`--drafter none`): one token per round, so the client can count tokens by itself."""
    target = tiny_target(0)
    path = tmp_path_factory.mktemp("bench") / "model"
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    args = ["--target", str(path), "--drafter", "none", "--threads", "1", "--max-active", "3"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


def test_bench_against_a_real_server_agrees_with_its_metrics(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["t5 t6 t7", "t11 t12", "t20 t30 t40 t50", "t9 t9 t9 t9"]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "bench"
    args = ["--url", server.url + "/v1", "--concurrency", "1,3", "--prompts", str(prompts), "--num-prompts", "6",
            "--max-tokens", "24", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "result.json").read_text())
    # the first of /v1/models: the target directory's name (a client never sees the server's local paths)
    assert report["model"] == Path(server.args[server.args.index("--target") + 1]).name
    for lv in report["levels"]:
        assert lv["requests"] == lv["completed"] == 6 and lv["errors"] == 0
        assert lv["tokens_counted_from"] == ["usage"]
        # The client's totals equal the server's own counters over the level, exactly.
        assert lv["output_tokens"] == lv["server"]["generation_tokens"] > 0
        assert lv["prompt_tokens"] == lv["server"]["prompt_tokens"]
        assert lv["server"]["acceptance_length"] == 1.0  # plain decoding: one token per forward
        for r in lv["per_request"]:
            # ... and with plain decoding each token is its own chunk, so the client counts them itself too
            # (the EOS token carries no text).
            chunks = len(r["chunk_gaps"]) + (r["ttft"] is not None)
            assert chunks == r["output_tokens"] - (r["finish_reason"] == "stop")
            assert 0 < r["ttft"] <= r["e2e"]
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p90"] <= lv["ttft_ms"]["p99"]
        assert lv["output_tokens_per_s"] > 0
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    assert "| 3 | 6 / 6 |" in (out / "result.md").read_text()
    for png in ("throughput.png", "latency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The completions endpoint too, with a request count that is not a multiple of the concurrency.
    args = ["--url", server.url, "--endpoint", "completions", "--concurrency", "2", "--prompts", str(prompts),
            "--num-prompts", "3", "--max-tokens", "8", "--out", str(tmp_path / "completions")]  # fmt: skip
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output
    (lv,) = json.loads((tmp_path / "completions" / "result.json").read_text())["levels"]
    assert lv["completed"] == 3 and lv["output_tokens"] == lv["server"]["generation_tokens"] > 0

    result = CliRunner().invoke(app, ["bench", "--url", server.url, "--model", "nope", "--num-prompts", "1"])
    assert result.exit_code == 2 and "HTTP 404" in result.output
