"""benchmarks/vs_speculators.py at toy size: a store converted into speculators' offline layout, speculators' own
trainer run on the CPU through the benchmark's patches, and the checkpoint it writes read back by draftsmith."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from draftsmith.formats.load import read_drafter
from draftsmith.store import HiddenStateStore, extract
from draftsmith.target import load_target
from draftsmith.vocab import DraftVocab, vocab_from_store
from tests.conftest import tiny_target
from tests.formats_helpers import greedy_samples

pytest.importorskip("speculators.train.cli")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_speculators.py"
LAYERS = (2, 3, 4)


def load_bench():
    spec = importlib.util.spec_from_file_location("vs_speculators", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_speculators_trains_on_the_converted_store_and_draftsmith_reads_its_checkpoint(tmp_path):
    bench = load_bench()
    model_dir = tmp_path / "model"
    source = tiny_target(5, layers=6)
    source.model.save_pretrained(model_dir)
    source.tokenizer.save_pretrained(model_dir)
    target = load_target(str(model_dir))
    store_dir = extract(
        target, greedy_samples(target, 10, new_tokens=24), tmp_path / "store", layer_ids=LAYERS, dtype="float32",
        progress=False,
    )  # fmt: skip
    vocab_from_store(store_dir, 64, tmp_path / "vocab")
    out = tmp_path / "out"

    data = bench.convert_store(Path(store_dir), tmp_path / "vocab", out)
    store = HiddenStateStore(store_dir)
    sample = store[3]
    files = load_file(data / "hidden_states" / "hs_3.safetensors")
    assert files["hidden_states"].shape == (len(sample["input_ids"]), len(LAYERS) + 1, 32)
    # what speculators' ArrowDataset reads: [:, :-1] flattened = the aux states, [:, -1] = the final state
    assert torch.equal(files["hidden_states"][:, :-1].flatten(1), sample["aux_hidden"])
    assert torch.equal(files["hidden_states"][:, -1], sample["last_hidden"])
    assert torch.equal(files["token_ids"], sample["input_ids"])
    vocab = DraftVocab.load(tmp_path / "vocab")
    assert np.array_equal(np.load(data / "d2t-64.npy"), vocab.d2t.numpy())
    assert bench.convert_store(Path(store_dir), tmp_path / "vocab", out) == data  # converted once

    verifier = bench.save_verifier(out, str(model_dir))
    job = {
        "chain": 2,
        "threads": 1,
        "target": str(model_dir),
        "verifier": str(verifier),
        "data": str(data),
        "d2t": str(data / "d2t-64.npy"),
        "t2d": str(data / "t2d-64.npy"),
        "layer_ids": list(LAYERS),
        "overrides": {"total_seq_len": 128},
        "steps_per_epoch": bench.speculators_steps_per_epoch(data, 128),
        "out": str(out / "speculators"),
        "max_steps": 3,
        "budget_s": None,
    }
    result = bench.run_worker("speculators", job, out / "logs" / "speculators.log")
    assert result["steps_done"] == 3 and result["settings"]["ttt_steps"] == 2
    converted = read_drafter(result["checkpoint"], target=target)
    config = converted.config
    assert config.aux_layer_ids == LAYERS and config.draft_vocab_size == 64
    assert config.norm_before_fc and config.norm_before_residual and config.norm_output  # speculators' defaults
    assert torch.equal(converted.state["d2t"], vocab.d2t)
