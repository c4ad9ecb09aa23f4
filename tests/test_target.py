"""The hidden-state index convention and target loading."""

import pytest
import torch

from draftsmith.attention import ATTENTION
from draftsmith.data.tokenize import encode_chat
from draftsmith.decode import tree
from draftsmith.errors import TargetError
from draftsmith.target import load_target
from tests.conftest import tiny_target


def reference_hidden_states(target, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def test_layer_id_i_is_the_input_of_decoder_layer_i():
    target = tiny_target(0, layers=4)
    ids = [0, 5, 6, 7, 8, 9]
    out = target.forward(torch.tensor(ids), target.new_cache(), layer_ids=(0, 1, 3))
    ref = reference_hidden_states(target, ids)
    width = target.hidden_size
    for slot, layer in enumerate((0, 1, 3)):
        torch.testing.assert_close(out.aux_hidden[:, slot * width : (slot + 1) * width], ref[layer][0])
    torch.testing.assert_close(out.aux_hidden[:, :width], target.model.model.embed_tokens(torch.tensor(ids)))


def test_hidden_states_with_kv_cache_match_a_full_forward():
    target = tiny_target(1, layers=3)
    ids = [0, 4, 8, 15, 16, 23, 42]
    cache = target.new_cache()
    first = target.forward(torch.tensor(ids[:4]), cache, layer_ids=(2,), logits_to_keep=1, last_hidden=True)
    rest = target.forward(torch.tensor(ids[4:]), cache, layer_ids=(2,), last_hidden=True)
    ref = reference_hidden_states(target, ids)
    torch.testing.assert_close(torch.cat([first.aux_hidden, rest.aux_hidden]), ref[2][0])
    torch.testing.assert_close(torch.cat([first.last_hidden, rest.last_hidden]), ref[-1][0])  # final, normed
    assert first.logits.shape == (1, target.vocab_size) and rest.logits.shape == (3, target.vocab_size)
    assert cache.get_seq_length() == len(ids)


def test_unknown_targets_fail_fast_with_a_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TargetError, match="not a built-in name") as err:
        load_target("no-such-org/no-such-model")
    assert "smollm2-135m" in err.value.hint
    with pytest.raises(TargetError, match="does not exist"):
        load_target(str(tmp_path / "missing"))
    with pytest.raises(TargetError, match="unknown dtype"):
        load_target("smollm2-135m", dtype="float8")


@pytest.mark.integration
def test_builtin_smollm2_loads_with_its_chat_template(smollm2):
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert smollm2.eos_token_ids == {2}  # <|im_end|>
    ids = encode_chat(smollm2.tokenizer, [{"role": "user", "content": "Hi"}])
    assert smollm2.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = smollm2.forward(torch.tensor(ids), smollm2.new_cache(), layer_ids=(2, 15, 27), logits_to_keep=1)
    ref = reference_hidden_states(smollm2, ids)
    torch.testing.assert_close(out.aux_hidden[:, 576 * 2 :], ref[27][0])
    assert len(smollm2.fingerprint()) == 16
    assert smollm2.model.config._attn_implementation == ATTENTION  # grouped-query SDPA on a CPU target


def test_the_grouped_attention_computes_what_transformers_attention_computes():
    """A CPU target runs `attention.ATTENTION` (`load_target`): a prefill, a one-token step and a verify forward
    under a draft tree's mask give the logits transformers' own SDPA gives (which copies the grouped heads)."""
    target = tiny_target(2, layers=3)
    parents = torch.tensor([-1, -1, 0, 0, 2])
    logits = {}
    for implementation in ("sdpa", ATTENTION):
        target.model.set_attn_implementation(implementation)
        cache = target.new_cache()
        prefill = target.forward(torch.tensor([0, 4, 8, 15, 16, 23]), cache)
        step = target.forward(torch.tensor([5]), cache)
        past = cache.get_seq_length()
        mask, positions = tree.verify_mask(parents, past, torch.float32), tree.verify_positions(parents, past)
        verify = target.forward(torch.tensor([6, 7, 9, 11, 13, 17]), cache, attention_mask=mask, position_ids=positions)
        logits[implementation] = (prefill.logits, step.logits, verify.logits)
    for ours, theirs in zip(logits[ATTENTION], logits["sdpa"], strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.integration
def test_builtin_target_reloads_from_the_cache(smollm2):
    """The dequantised safetensors copy is what later loads read: same weights, no GGUF work."""
    again = load_target("smollm2-135m")
    assert again.fingerprint() == smollm2.fingerprint()


def test_fingerprint_survives_save_and_reload_but_not_a_changed_weight(tmp_path):
    target = tiny_target(0)
    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    reloaded = load_target(str(tmp_path))
    assert reloaded.fingerprint() == target.fingerprint()
    with torch.no_grad():
        reloaded.model.model.norm.weight[0] += 1e-3
    assert reloaded.fingerprint() != target.fingerprint()
