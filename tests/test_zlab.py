"""Interop with z-lab's reference `dflash` package: our exports load in its `DFlashDraftModel` and decode exactly as
its `dflash_generate` does (same tokens, same acceptance length every round); its drafters load in draftsmith and
give the same draft logits. This pins the layer-id numbering (z-lab's id i = ours i + 1)."""

import json
import time

import pytest
import torch

from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.dflash import DFlashDrafter
from draftsmith.errors import DraftsmithError
from draftsmith.formats import zlab
from draftsmith.formats.load import build_drafter, load_drafter
from tests.conftest import tiny_target
from tests.test_dflash import make_model
from tests.test_engine import reference

dflash_model = pytest.importorskip("dflash.model", reason="z-lab's dflash package (pip install --no-deps dflash)")


@pytest.fixture(autouse=True)
def cpu_clock(monkeypatch):
    """`dflash_generate(return_stats=True)` times with torch.cuda.synchronize; on CPU a plain clock does."""
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


def reference_logits(ref, target, tokens: list[int], block_size: int) -> torch.Tensor:
    """z-lab's draft logits for the block after `tokens` (context = all but the last token), computed its way."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = target.model(ids[:, :-1], output_hidden_states=True)
        context = dflash_model.extract_context_feature(out.hidden_states, ref.target_layer_ids)
        block = torch.full((1, block_size), ref.mask_token_id)
        block[0, 0] = tokens[-1]
        noise = target.model.get_input_embeddings()(block)
        hidden = ref(
            target_hidden=context, noise_embedding=noise, position_ids=torch.arange(len(tokens) - 1 + block_size)[None]
        )
        return ref.compute_logits(hidden[0, 1:], target.model.get_output_embeddings())


def our_logits(drafter: DFlashDrafter, target, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    features = target.forward(ids[:-1], target.new_cache(), drafter.aux_layer_ids).aux_hidden
    drafter.begin(ids[:-1], features)
    return drafter.block_logits(ids, drafter.block_size - 1)


def rounds(target, drafter, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """Our tokens and tokens gained per verify round (the prefill's token is not a round, as in z-lab's stats)."""
    gained, before = [], 1
    for g in SpeculativeDecoder(target, drafter, drafter.block_size - 1).rounds(prompt, max_new_tokens):
        gained.append(len(g.tokens) - before)
        before = len(g.tokens)
    return g.tokens, gained[1:]


def assert_same_decoding(ref, target, drafter, prompt: list[int], max_new_tokens: int) -> int:
    """Same tokens and per-round acceptance lengths over the rounds whose block was full in both (z-lab drafts one
    more token than can be kept in its last round, so the final round may differ); returns the rounds compared."""
    eos = sorted(target.eos_token_ids)
    stats = dflash_model.dflash_generate(
        ref, target.model, torch.tensor([prompt]), max_new_tokens + drafter.block_size, eos, return_stats=True
    )
    theirs = stats.output_ids[0, len(prompt) :].tolist()
    ours, gained = rounds(target, drafter, prompt, max_new_tokens)
    full = 0
    while full < len(gained) and sum(gained[: full + 1]) + drafter.block_size <= max_new_tokens:
        full += 1
    if ours[-1] in target.eos_token_ids:  # stopped by itself: every round counts, and the outputs are whole
        full = len(gained)
        assert theirs == ours
    kept = 1 + sum(gained[:full])
    assert theirs[:kept] == ours[:kept]
    assert stats.acceptance_lengths[:full] == gained[:full]
    return full


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_export_loads_in_zlab_and_decodes_the_same(tmp_path, seed, block_size):
    target = tiny_target(seed, vocab_size=6, layers=6, eos_token_id=5)  # 6 tokens: many drafts accepted
    model = make_model(target, block_size, seed=seed, ids=(1, 3, 5))
    zlab.export(model, tmp_path, dtype="float32")
    ref = dflash_model.DFlashDraftModel.from_pretrained(tmp_path).eval()
    assert ref.target_layer_ids == [0, 2, 4] and ref.block_size == block_size
    tokens = [0, 2, 3, 4, 2, 3]
    drafter = DFlashDrafter(model)
    torch.testing.assert_close(our_logits(drafter, target, tokens), reference_logits(ref, target, tokens, block_size))
    assert assert_same_decoding(ref, target, DFlashDrafter(model), [0, 2, 3, 4], 48) >= 1


def zlab_drafter(target, layers: int, zlab_ids: list[int], block_size: int, mask: int, seed: int = 0):
    """A drafter built by z-lab's own class (random weights, norms moved off 1)."""
    from transformers import Qwen3Config

    c = target.config
    config = Qwen3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        num_target_layers=c.num_hidden_layers,
        dflash_config={"block_size": block_size, "mask_token_id": mask}
        | ({} if zlab_ids is None else {"target_layer_ids": zlab_ids}),
    )
    config.architectures = ["DFlashDraftModel"]
    torch.manual_seed(seed)
    ref = dflash_model.DFlashDraftModel(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.3)
    return ref


def test_zlab_drafter_loads_and_gives_the_same_logits(tmp_path):
    target = tiny_target(2, vocab_size=6, layers=6, eos_token_id=5)
    ref = zlab_drafter(target, 2, [0, 3], 8, mask=4)
    ref.save_pretrained(tmp_path)
    for drafter in (load_drafter(tmp_path, target), build_drafter(f"dflash:{tmp_path}", target, draft_length="fixed")):
        assert isinstance(drafter, DFlashDrafter) and drafter.aux_layer_ids == (1, 4)  # z-lab 0, 3 = ours 1, 4
        tokens = [0, 2, 3, 4, 2, 3, 1]
        torch.testing.assert_close(our_logits(drafter, target, tokens), reference_logits(ref, target, tokens, 8))
    assert assert_same_decoding(ref, target, drafter, [0, 2, 3, 4], 48) >= 1


def test_zlab_config_without_layer_ids_uses_zlab_default(tmp_path):
    target = tiny_target(2, layers=8)
    ref = zlab_drafter(target, 3, None, 16, mask=7)
    ref.save_pretrained(tmp_path)
    assert load_drafter(tmp_path, target).aux_layer_ids == tuple(i + 1 for i in ref.target_layer_ids)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dflash_config": {"block_size": 1, "mask_token_id": 4, "target_layer_ids": [0, 3]}}, "block size"),
        ({"dflash_config": {"block_size": 8, "mask_token_id": 6, "target_layer_ids": [0, 3]}}, "mask token 6"),
        ({"dflash_config": {"block_size": 8, "mask_token_id": 4, "target_layer_ids": [0, 5]}}, r"layers \[1, 6\]"),
        ({"hidden_size": 64}, "hidden size 64"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ],
)
def test_bad_zlab_checkpoints_fail_in_one_line(tmp_path, change, message):
    target = tiny_target(2, vocab_size=6, layers=6, eos_token_id=5)
    zlab_drafter(target, 2, [0, 3], 8, mask=4).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(DraftsmithError, match=message) as err:
        load_drafter(tmp_path, target)
    assert "\n" not in err.value.message


@pytest.mark.integration
def test_smollm2_export_decodes_like_zlab(smollm2, tmp_path):
    """The Must-hold check on the real target: same tokens and acceptance lengths as `dflash_generate` at T=0."""
    model = make_model(smollm2, 16, layers=1, ids=(16,))
    zlab.export(model, tmp_path, dtype="float32")
    ref = dflash_model.DFlashDraftModel.from_pretrained(tmp_path).eval()
    prompt = encode_chat(smollm2.tokenizer, [{"role": "user", "content": "Count from one to twenty."}])
    drafter = DFlashDrafter(model)
    torch.testing.assert_close(
        our_logits(drafter, smollm2, prompt), reference_logits(ref, smollm2, prompt, 16), atol=2e-4, rtol=2e-4
    )
    assert assert_same_decoding(ref, smollm2, DFlashDrafter(model), prompt, 32) >= 1
    ours = SpeculativeDecoder(smollm2, DFlashDrafter(model), 15).generate(prompt, 32).tokens
    assert ours == reference(smollm2, prompt, 32)  # and both are the target's own greedy output
