"""speculators 0.9.0's DFlash layout, both ways, tested against the library's own `DFlashDraftModel`."""

import json

import pytest
import torch

from draftsmith.drafters.dflash import DFlashDrafter, save_checkpoint
from draftsmith.errors import DraftsmithError
from draftsmith.formats.export import export
from draftsmith.formats.inspect import describe
from draftsmith.formats.load import load_drafter
from draftsmith.target import load_target
from tests.conftest import saved_tiny_model
from tests.test_dflash import make_model
from tests.test_zlab import our_logits

dflash_models = pytest.importorskip("speculators.models.dflash", reason="speculators 0.9.0")


@pytest.fixture
def target_dir(tmp_path):
    return saved_tiny_model(tmp_path / "target")


def speculators_drafter(verifier: str, ids: list[int], block_size: int, mask: int):
    """A drafter built by speculators' own classes (random body), its embeddings and head from the verifier."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=96, max_position_embeddings=256)  # fmt: skip
    proposal = GreedyTokenProposalConfig(speculative_tokens=block_size - 1)
    config = dflash_models.DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=96, block_size=block_size, aux_hidden_state_layer_ids=ids,
        mask_token_id=mask, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[proposal], default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"])),
    )  # fmt: skip
    torch.manual_seed(0)
    model = dflash_models.DFlashDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("layers.", "fc.", "hidden_norm.", "norm.")):
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.3)
    model.load_verifier_weights()
    return model


def test_speculators_drafter_loads_with_its_weights(tmp_path, target_dir):
    theirs = speculators_drafter(target_dir, [1, 3], 8, mask=95)
    theirs.save_pretrained(tmp_path / "spec")
    target = load_target(target_dir)
    drafter = load_drafter(tmp_path / "spec", target)
    assert isinstance(drafter, DFlashDrafter) and drafter.aux_layer_ids == (1, 3) and drafter.block_size == 8
    ours = drafter.model.state_dict()
    body = {k: v for k, v in theirs.state_dict().items() if k in ours}
    assert len(body) == len(ours) and all(torch.equal(ours[k], v) for k, v in body.items())
    info = describe(tmp_path / "spec")
    assert info["format"] == "speculators" and info["layer_ids"]["engine"] == [1, 3]


def test_export_speculators_loads_in_speculators_and_back(tmp_path, target_dir):
    target = load_target(target_dir)
    model = make_model(target, 8, ids=(1, 3))
    save_checkpoint(model, tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "spec", "speculators", verifier=target_dir)
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["aux_hidden_state_layer_ids"] == [1, 3]
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    theirs = dflash_models.DFlashDraftModel.from_pretrained(tmp_path / "spec")
    for k, v in model.state_dict().items():
        if k in theirs.state_dict() and not k.startswith(("embed_tokens", "lm_head")):
            assert torch.equal(theirs.state_dict()[k], v), k
    back = load_drafter(tmp_path / "spec", target)
    tokens = [0, 5, 7, 9, 11, 13]
    torch.testing.assert_close(our_logits(back, target, tokens), our_logits(DFlashDrafter(model), target, tokens))
    assert "vllm serve" in (tmp_path / "spec" / "README.md").read_text()


def test_reduced_vocabulary_is_refused_in_one_line(tmp_path, target_dir):
    speculators_drafter(target_dir, [1, 3], 8, mask=95).save_pretrained(tmp_path / "spec")
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    (tmp_path / "spec" / "config.json").write_text(json.dumps(raw | {"draft_vocab_size": 32}))
    with pytest.raises(DraftsmithError, match="reduced draft vocabulary") as err:
        load_drafter(tmp_path / "spec", load_target(target_dir))
    assert "\n" not in err.value.message
