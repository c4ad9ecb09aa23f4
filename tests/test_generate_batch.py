"""The batched decode loop of regeneration and synthesis: the tokens of plain decoding, whatever the batch does."""

import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM
from transformers.cache_utils import DynamicLayer

from draftsmith.backends.batch import PreallocatedLayer, batch_cache, batched_attention, generate_batch
from tests.conftest import tiny_target

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
            if temperature > 0:
                chosen = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)[:, 0]
            else:
                chosen = logits.argmax(-1)
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
