"""The EAGLE-3 drafter: layout, initialisation, checkpoints, and the training-time test against real drafting."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Model,
    save_checkpoint,
)
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.formats.load import load_drafter
from draftsmith.packed import Int8Linear, PackedLinear
from draftsmith.train.losses import StepCache, ttt_forward
from tests.conftest import tiny_target
from tests.test_engine import reference

LAYERS = (0, 2, 3)


def draft_vocab(vocab_size: int, draft_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random subset of the target vocabulary in random order (draft ids need not follow target ids)."""
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_size]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_size), t2d


def make_model(target, draft_size: int = 48, seed: int = 0) -> Eagle3Model:
    """A random drafter with non-trivial norm weights, so a wrong norm or residual cannot hide."""
    d2t, t2d = draft_vocab(target.vocab_size, draft_size, seed)
    config = Eagle3Config.from_target(target, draft_size, LAYERS)
    torch.manual_seed(seed)
    model = Eagle3Model.from_weights(
        config, target.model.get_input_embeddings().weight, target.model.lm_head.weight, d2t, t2d
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


EXPECTED = {
    "fc.weight": (32, 96),
    "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,),
    "midlayer.self_attn.q_proj.weight": (32, 64),
    "midlayer.self_attn.k_proj.weight": (16, 64),
    "midlayer.self_attn.v_proj.weight": (16, 64),
    "midlayer.self_attn.o_proj.weight": (32, 32),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (64, 32),
    "midlayer.mlp.up_proj.weight": (64, 32),
    "midlayer.mlp.down_proj.weight": (32, 64),
    "norm.weight": (32,),
    "lm_head.weight": (48, 32),
    "embed_tokens.weight": (96, 32),
}


def test_parameter_names_shapes_and_forward():
    target = tiny_target(0)
    model = make_model(target)
    assert {k: tuple(v.shape) for k, v in model.named_parameters()} == EXPECTED
    assert {k: tuple(v.shape) for k, v in model.named_buffers()} == {"d2t": (48,), "t2d": (96,)}
    assert model.config.aux_layer_ids == LAYERS and model.config.target_fingerprint == target.fingerprint()
    embeds, hidden = torch.randn(2, 5, 32), model.fuse(torch.randn(2, 5, 96))
    out, logits = model(embeds, hidden, torch.arange(5))
    assert out.shape == (2, 5, 32) and logits.shape == (2, 5, 48)
    assert torch.allclose(logits, model.lm_head(model.norm(out)))


def test_embeddings_frozen_and_head_initialised_from_target_rows():
    target = tiny_target(1)
    model = make_model(target)
    draft_to_target = torch.arange(48) + model.d2t
    assert torch.equal(model.embed_tokens.weight, target.model.get_input_embeddings().weight)
    assert torch.equal(model.lm_head.weight, target.model.lm_head.weight[draft_to_target])
    assert model.embed_tokens.weight.data_ptr() != target.model.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(0, 96, (1, 6))
    _, logits = model(model.embed_tokens(ids), model.fuse(torch.randn(1, 6, 96)), torch.arange(6))
    logits.sum().backward()
    assert model.embed_tokens.weight.grad is None and model.fc.weight.grad is not None


def test_bad_config_and_vocabulary_are_clear_errors():
    target = tiny_target(0)
    with pytest.raises(ConfigError, match="3 aux layer ids"):
        Eagle3Config.from_target(target, 48, (0, 9, 2))
    d2t, t2d = draft_vocab(96, 48)
    t2d[torch.nonzero(~t2d)[0]] = True
    config = Eagle3Config.from_target(target, 48, LAYERS, fingerprint="x")
    with pytest.raises(DraftsmithError, match="d2t and t2d disagree"):
        Eagle3Model.from_weights(config, torch.zeros(96, 32), torch.zeros(96, 32), d2t, t2d)


def test_checkpoint_round_trip(tmp_path):
    target = tiny_target(2)
    model = make_model(target)
    save_checkpoint(model, tmp_path / "checkpoints" / "step-000007")
    (tmp_path / "latest").write_text("checkpoints/step-000007\n")
    for path in (tmp_path / "checkpoints" / "step-000007", tmp_path):  # a checkpoint, or a run directory
        drafter = load_drafter(path, target)
        assert drafter.aux_layer_ids == LAYERS
        loaded = drafter.model.state_dict()
        assert loaded.keys() == model.state_dict().keys()
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_checkpoint_for_another_target_fails_before_loading(tmp_path):
    target = tiny_target(2)
    save_checkpoint(make_model(target), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_size": 64}))
    with pytest.raises(DraftsmithError, match="hidden size 64 != target 32"):
        load_drafter(tmp_path, target)
    with pytest.raises(DraftsmithError, match="config.json not found"):
        load_drafter(tmp_path / "missing", target)


def test_step_cache_is_the_block_mask_over_all_steps():
    """StepCache equals plain attention over the K*L keys of every step with the TTT block mask: step k at t sees
    step 0 at positions <= t and steps 1..k at t only."""
    torch.manual_seed(0)
    b, heads, kv_heads, length, dim, steps = 2, 4, 2, 7, 8, 4
    cache = StepCache()
    keys, values = [], []
    for k in range(steps):
        q = torch.randn(b, heads, length, dim, dtype=torch.float64)
        keys.append(torch.randn(b, kv_heads, length, dim, dtype=torch.float64))
        values.append(torch.randn(b, kv_heads, length, dim, dtype=torch.float64))
        out = cache.attend(q, keys[-1], values[-1])
        t = torch.arange(length)[:, None]
        s = torch.arange(length)[None, :]
        mask = torch.cat([s <= t] + [s == t] * k, dim=1)  # (L, (k+1)*L)
        expected = F.scaled_dot_product_attention(
            q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
        )
        assert torch.allclose(out, expected, atol=1e-12), k


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ttt_step_k_equals_inference_drafting(temperature):
    """The point of the training-time test: for random weights and inputs, TTT step k at position t computes the
    same distribution as the drafter's (k+1)-th draft token after a context of t+1 positions, across several
    propose / accept rounds with random acceptance lengths (so the cache rollback is exercised)."""
    target = tiny_target(3)
    model = make_model(target, seed=3).double()
    draft_ids = torch.arange(48) + model.d2t
    gen = torch.Generator().manual_seed(0)
    steps, length = 5, 40
    x = torch.randint(0, 96, (length,), generator=gen)
    f = torch.randn(length, 96, generator=gen, dtype=torch.float64)
    drafter = Eagle3Drafter(model)
    drafter.begin(x[:4], f[:4])
    tokens, rounds = x[:5], 0
    while len(tokens) + steps < length:
        t = len(tokens) - 2  # the last context position: its feature and next token are both known
        draft = drafter.propose(tokens, steps, temperature, gen)
        # TTT over what the drafter saw: the context, then its own drafts; features after t must not matter.
        seq = torch.cat([tokens, draft.tokens[:-1]])
        feats = torch.cat([f[: t + 1], torch.randn(len(seq) - t - 1, 96, dtype=torch.float64)])
        with torch.no_grad():
            logits = [model.draft_logits(h[0, t]) for h in ttt_forward(model, seq[None], feats[None], steps)]
        for k in range(steps):
            assert int(draft.tokens[k]) == int(draft_ids[logits[k].argmax()]) or temperature > 0
            if temperature > 0:
                q = torch.zeros(96, dtype=torch.float64)
                q[draft_ids] = torch.softmax(logits[k] / temperature, -1)
                assert torch.allclose(draft.probs[k], q, atol=1e-12), (t, k)
        # The target confirms n drafts and adds one token; the drafter must not care whether they were its own.
        n = int(torch.randint(0, steps + 1, (1,), generator=gen))
        drafter.accepted(n, f[t + 1 : t + 2 + n])
        tokens = x[: len(tokens) + n + 1]
        rounds += 1
    assert rounds >= 5


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_greedy_speculative_output_equals_generate(seed, k, precision):
    target = tiny_target(seed)
    drafter = Eagle3Drafter(make_model(target, seed=seed), precision=precision)
    prompt = [0] + torch.randint(2, 90, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = SpeculativeDecoder(target, drafter, k).generate(prompt, 40)
    assert out.tokens == reference(target, prompt, 40)


def test_int8_drafter_proposes_what_the_float32_one_does_and_keeps_its_weights():
    """int8 weights move the drafter's logits by ~1 %: its greedy drafts must almost always be the float32
    drafter's, and the float32 weights (what a checkpoint or an export saves) must stay untouched."""
    target = tiny_target(5)
    model = make_model(target, seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    drafters = [Eagle3Drafter(copy.deepcopy(model), precision=p) for p in ("float32", "int8")]
    assert isinstance(drafters[1].model.fc, Int8Linear) and isinstance(drafters[0].model.fc, PackedLinear)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 90, (60,), generator=gen)
    feats = torch.randn(60, 96, generator=gen)
    same = total = 0
    for end in range(8, 60, 4):
        drafts = []
        for d in drafters:
            d.begin(tokens[: end - 1], feats[: end - 1])
            drafts.append(d.propose(tokens[:end], 4, 0.0, gen).tokens)
        same += int((drafts[0] == drafts[1]).sum())
        total += len(drafts[0])
    assert total == 4 * 13 and same >= 0.9 * total, (same, total)
    assert all(torch.equal(before[k], v) for k, v in drafters[1].model.state_dict().items())
    with pytest.raises(ConfigError, match="unknown drafter precision"):
        Eagle3Drafter(model, precision="int4")


def test_sampled_drafts_run_through_the_engine_reproducibly():
    target = tiny_target(4)
    drafter = Eagle3Drafter(make_model(target, seed=4))
    decoder = SpeculativeDecoder(target, drafter, 4)
    first = decoder.generate([0, 7, 8, 9], 30, temperature=1.0, seed=11)
    again = decoder.generate([0, 7, 8, 9], 30, temperature=1.0, seed=11)
    assert first.tokens == again.tokens and 1 <= len(first.tokens) <= 30
    assert all(0 <= t < 96 for t in first.tokens)


def test_adaptive_budget_is_lossless_and_rests_when_drafts_do_not_pay():
    """A random drafter is useless: the adaptive budget must stop proposing and mostly skip the drafter, while the
    output stays exactly the target's."""
    from draftsmith.drafters.budget import DraftBudget

    target = tiny_target(1)
    budget = DraftBudget()
    drafter = Eagle3Drafter(make_model(target, seed=1), budget=budget)
    calls = []
    forward = drafter.model.forward_hidden
    drafter.model.forward_hidden = lambda *a, **k: calls.append(1) or forward(*a, **k)
    prompt = [0, 5, 6, 7, 8]
    out = SpeculativeDecoder(target, drafter, 7).generate(prompt, 60)
    assert out.tokens == reference(target, prompt, 60)
    rounds = out.target_forwards - 1
    assert sum(out.proposed[:1]) < rounds / 4  # few rounds carried a draft
    assert len(calls) < rounds / 2  # and most rounds never ran the drafter at all


def test_logit_lens_start_predicts_the_targets_head_on_the_deepest_aux_state():
    """With `start_from_logit_lens` the untrained drafter's first draft is lm_head(final_norm(h_high)): the layer is
    the identity and fc passes the deepest aux state through, whatever its scale."""
    target = tiny_target(2)
    model = make_model(target)
    final_norm = target.model.model.norm
    model.start_from_logit_lens(final_norm.weight.detach())
    h = model.config.hidden_size
    aux = torch.randn(1, 5, 3 * h)
    embeds = model.embed_tokens(torch.randint(0, target.vocab_size, (1, 5)))
    out, logits = model(embeds, model.fuse(aux), torch.arange(5))
    assert torch.allclose(out, aux[..., 2 * h :], atol=1e-6)
    lens = final_norm(3.0 * aux[..., 2 * h :]) @ model.lm_head.weight.T
    assert torch.allclose(logits, lens, atol=1e-4)
