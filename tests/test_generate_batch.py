"""The batched decode loop of regeneration and synthesis: the tokens of plain decoding, whatever the batch does."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.cache_utils import DynamicLayer

from draftsmith import attention as attention_module
from draftsmith.backends.batch import (
    BatchDecoder,
    PreallocatedLayer,
    batch_cache,
    batched_attention,
    choose,
    generate_batch,
    sample,
)
from draftsmith.native import native_kernel
from draftsmith.target import Target
from tests.conftest import tiny_target, tiny_tokenizer

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52, 53, 54, 55]]


def reference(target, prompts, *, temperature, max_new_tokens, stop_ids):
    """The loop as it was before: transformers' DynamicCache grown by cat, the 2-D mask grown and rebuilt every step."""
    model, width = target.model, max(map(len, prompts))
    ids = torch.tensor([[1] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    rows, new, ended = list(range(len(prompts))), [[] for _ in prompts], [False] * len(prompts)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), batched_attention(model):
        for _ in range(max_new_tokens):
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, logits_to_keep=1
            ).logits[:, -1]
            chosen = choose(logits, temperature) if temperature > 0 else logits.argmax(-1)  # the sampler: see below
            keep = [i for i, t in enumerate(chosen.tolist()) if t not in stop_ids]
            for i, t in enumerate(chosen.tolist()):
                ended[rows[i]] |= t in stop_ids
                if t not in stop_ids:
                    new[rows[i]].append(t)
            if not keep:
                break
            index = torch.tensor(keep)
            for layer in cache.layers:
                layer.batch_select_indices(index)
            rows, chosen, mask, positions = [rows[i] for i in keep], chosen[index], mask[index], positions[index]
            ids, mask, positions = (
                chosen[:, None],
                torch.cat([mask, mask.new_ones(len(rows), 1)], -1),
                positions[:, -1:] + 1,
            )
    return list(zip(new, ended, strict=True))


def stops_midway(target, prompts, max_new_tokens):
    """Stop ids that end some rows early and at different steps: each row's 2nd..4th greedy tokens, in turn."""
    free = generate_batch(target, prompts, temperature=0.0, max_new_tokens=max_new_tokens, stop_ids={1})
    return {tokens[1 + i % 3] for i, (tokens, _) in enumerate(free[::2])}


def test_greedy_batch_equals_model_generate_per_prompt_with_rows_leaving_midway():
    target = tiny_target(seed=7)
    stop = stops_midway(target, PROMPTS, 12)
    got = generate_batch(target, PROMPTS, temperature=0.0, max_new_tokens=12, stop_ids=stop)
    assert any(ended for _, ended in got) and not all(ended for _, ended in got)
    for prompt, (tokens, ended) in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([prompt])
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=sorted(stop),
            pad_token_id=1,
        )[0, len(prompt) :].tolist()  # fmt: skip
        cut = next((i for i, t in enumerate(out) if t in stop), None)
        assert (tokens, ended) == ((out, False) if cut is None else (out[:cut], True))


def test_same_tokens_as_the_dynamic_cache_loop_greedy_and_sampled():
    target = tiny_target(seed=8)
    stop = stops_midway(target, PROMPTS, 10)
    for temperature in (0.0, 1.0):
        torch.manual_seed(3)
        want = reference(target, PROMPTS, temperature=temperature, max_new_tokens=10, stop_ids=stop)
        torch.manual_seed(3)
        got = generate_batch(target, PROMPTS, temperature=temperature, max_new_tokens=10, stop_ids=stop)
        assert got == want
    same_length = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]  # no padding: decode steps run without a mask
    assert generate_batch(target, same_length, temperature=0.0, max_new_tokens=6, stop_ids={1}) == reference(
        target, same_length, temperature=0.0, max_new_tokens=6, stop_ids={1}
    )


@pytest.mark.parametrize("vocab", [1024, 1070], ids=["whole-blocks", "padded"])
def test_sample_draws_from_the_softmax(vocab):
    """Chi-square over 200,000 draws against softmax(logits), tokens grouped so each group expects >= 50 draws (the
    statistic's approximation holds), at a level of 1e-4; tokens of probability 0 are never drawn."""
    torch.manual_seed(11)
    logits = torch.randn(vocab) * 3
    logits[::7] = float("-inf")
    probs = torch.softmax(logits, -1).double()
    draws = torch.cat([sample(logits.expand(10_000, vocab)) for _ in range(20)])
    counts = torch.bincount(draws, minlength=vocab).double()
    assert draws.max() < vocab and counts[::7].sum() == 0
    order = probs.argsort(descending=True)
    expected, observed, e, o = [], [], 0.0, 0.0
    for i in order.tolist():  # the likeliest tokens alone, the tail pooled into groups of >= 50 expected draws
        e, o = e + len(draws) * probs[i].item(), o + counts[i].item()
        if e >= 50:
            expected.append(e), observed.append(o)
            e, o = 0.0, 0.0
    expected[-1], observed[-1] = expected[-1] + e, observed[-1] + o
    expected, observed = torch.tensor(expected), torch.tensor(observed)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    assert dof > 100
    assert chi2 < dof + 3.72 * (2 * dof) ** 0.5  # the normal approximation of chi2(dof) at p = 1e-4


def test_preallocated_layer_matches_dynamic_layer_and_grows_past_its_capacity():
    torch.manual_seed(0)
    ours, theirs = PreallocatedLayer(capacity=3), DynamicLayer()
    for n in (2, 1, 1, 2):  # 6 tokens through a 3-token buffer
        k, v = torch.randn(4, 2, n, 8), torch.randn(4, 2, n, 8)
        for a, b in zip(ours.update(k, v), theirs.update(k, v), strict=True):
            assert torch.equal(a, b)
    index = torch.tensor([1, 3])
    ours.batch_select_indices(index)
    theirs.batch_select_indices(index)
    k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    for a, b in zip(ours.update(k, v), theirs.update(k, v), strict=True):
        assert torch.equal(a, b)
    assert ours.get_seq_length() == theirs.get_seq_length() == 7


def test_sliding_window_models_keep_transformers_cache():
    assert all(isinstance(layer, PreallocatedLayer) for layer in batch_cache(tiny_target().model, 16).layers)
    config = MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8,
    )  # fmt: skip
    cache = batch_cache(MistralForCausalLM(config), 16)
    assert isinstance(cache, DynamicCache) and not any(isinstance(x, PreallocatedLayer) for x in cache.layers)


def needs_attention_kernel():
    if native_kernel("decode_attention") is None:
        pytest.skip("the decode attention kernel could not be built here (no C++ compiler?); torch's path serves")


@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(3, 3, 64), (2, 4, 64), (1, 1, 128), (2, 2, 128)])
def test_the_native_decode_attention_computes_what_float32_attention_computes(kv_heads, groups, dim):
    """bf16 keys and values read from a view of a larger buffer; rows left-padded, one row seeing a single slot, a
    whole block of 16 unwritten slots (skipped without arithmetic), a context that is not a multiple of 16."""
    needs_attention_kernel()
    torch.manual_seed(kv_heads * 10 + groups + dim)
    batch, capacity, used = 5, 53, 41
    query = torch.randn(batch, kv_heads * groups, 1, dim).bfloat16()
    buffer = torch.randn(2, batch, kv_heads, capacity, dim).bfloat16()
    key, value = buffer[0, :, :, :used], buffer[1, :, :, :used]  # strided along the batch, as a cache's used part
    mask = torch.ones(batch, 1, 1, used, dtype=torch.bool)
    mask[1, ..., :9] = False  # left padding
    mask[2, ..., :-1] = False  # sees only its newest slot
    mask[3, ..., 16:32] = False  # a whole block hidden
    want = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    got = attention_module._decode_attention(query, key, value, mask, None)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    assert (got.float() - want).abs().max() < 0.5 * (torch_path(query, key, value, mask).float() - want).abs().max()


def torch_path(query, key, value, mask):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "LOW_PRECISION", ())
        return attention_module._decode_attention(query, key, value, mask, None)


def test_bf16_decoding_with_the_native_attention_is_as_close_to_float32_as_torchs():
    """A Llama with 64-wide heads (the kernel's shapes) decoding left-padded rows in bf16, fed the float32 copy's
    greedy tokens: its logits are as close to float32's as with torch's bf16 attention (bf16 rounding alone moves
    them by ~0.06 here, so the two bf16 paths need not pick the same tokens), and the kernel really ran."""
    needs_attention_kernel()
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.3, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    exact = decode_logits(Target("f32", model, tiny_tokenizer(96)), steps=8)
    bf16 = Target("bf16", copy.deepcopy(model).to(torch.bfloat16), tiny_tokenizer(96))
    calls = []
    kernel = native_kernel("decode_attention")

    class Counting:
        @staticmethod
        def decode_attention(*args):
            calls.append(1)
            return kernel.decode_attention(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "native_kernel", lambda name: Counting)
        native = decode_logits(bf16, feed=exact[1])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "LOW_PRECISION", ())
        torchs = decode_logits(bf16, feed=exact[1])
    assert len(calls) == 8 * config.num_hidden_layers
    error = {name: (got[0][1:] - exact[0][1:]).abs().mean() for name, got in (("native", native), ("torch", torchs))}
    assert error["native"] < 1.1 * error["torch"], error


def decode_logits(target, steps=8, feed=None):
    """(logits after the prefill and each step (steps + 1, rows, vocab), the tokens fed): greedy, or `feed`'s."""
    logits, fed = [], []
    with torch.inference_mode(), batched_attention(target.model):
        decoder = BatchDecoder(target, PROMPTS, steps + 1)
        logits.append(decoder.logits)
        for step in range(steps if feed is None else len(feed)):
            token = decoder.logits.argmax(-1) if feed is None else feed[step]
            fed.append(token)
            logits.append(decoder.step(token))
    return torch.stack(logits).float(), torch.stack(fed)
