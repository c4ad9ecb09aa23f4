"""The loss mask: exactly the assistant contents and their end-of-turn token, never headers or user text.

A wrong mask is the most common cause of a useless drafter, so the SmolLM2 test spells out the whole rendering.
"""

import pytest

from draftsmith.data.sources import Conversation
from draftsmith.data.tokenize import render_chat, render_mask, tokenize_conversation, tokenize_dataset
from draftsmith.errors import DataError
from tests.conftest import tiny_tokenizer

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "3 + 3 = 6."},
]


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of masked-in tokens."""
    runs, run = [], []
    for token, learned in zip([*ids, None], [*mask, 0], strict=True):
        if learned:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return runs


@pytest.mark.integration
def test_smollm2_mask_is_assistant_content_and_im_end(smollm2):
    ids, mask = tokenize_conversation(smollm2.tokenizer, TWO_TURNS, max_length=512)
    rendering = render_mask(smollm2.tokenizer, ids, mask)
    print(rendering)
    assert rendering == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n[[2 + 2 = 4.<|im_end|>]]\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n[[3 + 3 = 6.<|im_end|>]]\n"
    )
    assert masked_runs(smollm2.tokenizer, ids, mask) == ["2 + 2 = 4.<|im_end|>", "3 + 3 = 6.<|im_end|>"]
    # The same ids the target sees at inference: the template's own tokenisation.
    full = smollm2.tokenizer.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    assert ids == list(full)


@pytest.mark.integration
def test_smollm2_default_system_prompt_is_not_learned(smollm2):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    ids, mask = tokenize_conversation(smollm2.tokenizer, messages, max_length=512)
    assert "You are a helpful AI assistant named SmolLM" in render_mask(smollm2.tokenizer, ids, mask)
    assert masked_runs(smollm2.tokenizer, ids, mask) == ["Hello! How can I help?<|im_end|>"]


def test_fallback_without_chat_template_masks_content_and_eos():
    tok = tiny_tokenizer(96)
    assert tok.chat_template is None
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7 t8"}]
    assert render_chat(tok, messages) == "user: t5 t6\nassistant: t7 t8t1\n"
    assert render_chat(tok, messages[:1], add_generation_prompt=True) == "user: t5 t6\nassistant: "
    ids, mask = tokenize_conversation(tok, messages, max_length=64)
    assert render_mask(tok, ids, mask) == "t0 t0 t5 t6 t0 t0[[t7 t8 t1]]"
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [7, 8, 1]  # t1 is the EOS


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        ("true", "t0 t5 t1 t2 t0[[t7 t8 t1]]t2"),  # ChatML-like: content, end-of-turn t1, then a separator t2
        # A template that drops empty messages: the turn's end cannot be told from its content, so all is learned.
        ("m.content", "t0 t5 t1 t2 t0[[t7 t8 t1 t2]]"),
    ],
)
def test_templated_mask_learns_the_end_of_turn_token_only_when_it_can_find_it(guard, expected):
    tok = tiny_tokenizer(96)
    tok.chat_template = (
        "{% for m in messages %}{% if " + guard + " %}{{ m.role }} {{ m.content }} t1 t2 {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    messages = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t7 t8"}]
    ids, mask = tokenize_conversation(tok, messages, max_length=64)
    assert render_mask(tok, ids, mask) == expected


def test_truncation_keeps_the_first_tokens():
    tok = tiny_tokenizer(96)
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7 t8 t9 t10"}]
    full_ids, full_mask = tokenize_conversation(tok, messages, max_length=64)
    ids, mask = tokenize_conversation(tok, messages, max_length=8)
    assert (ids, mask) == (full_ids[:8], full_mask[:8])
    assert len(ids) == 8 and sum(mask) == 2


def test_conversation_without_assistant_turn_is_an_error():
    with pytest.raises(DataError, match="conversation 'q7' has no assistant turn") as err:
        tokenize_conversation(tiny_tokenizer(96), [{"role": "user", "content": "t5"}], 64, conv_id="q7")
    assert "--regenerate" in err.value.hint


def test_template_that_is_not_prefix_stable_is_an_error():
    tok = tiny_tokenizer(96)
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }} {{ m.content }}{% if loop.last %} t2{% endif %} {% endfor %}"
    )
    messages = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t7"}]
    with pytest.raises(DataError, match="conversation 'c1': the chat template is not prefix-stable"):
        tokenize_conversation(tok, messages, 64, conv_id="c1")


def test_template_refusal_names_the_conversation():
    tok = tiny_tokenizer(96)
    tok.chat_template = (
        "{% if messages[0].role == 'assistant' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    )
    with pytest.raises(DataError, match="conversation 'c2': the chat template .* refused it: roles must alternate"):
        tokenize_conversation(tok, [{"role": "assistant", "content": "t7"}], 64, conv_id="c2")


def long_prompt(conv_id: str, n_user_tokens: int) -> Conversation:
    user = " ".join(["t5"] * n_user_tokens)
    return Conversation(conv_id, [{"role": "user", "content": user}, {"role": "assistant", "content": "t7 t8"}])


def test_dataset_whose_tokens_are_all_masked_out_fails_before_iterating():
    convs = [long_prompt("a", 30), long_prompt("b", 40)]
    with pytest.raises(DataError, match="all 2 conversations have every token masked out"):
        tokenize_dataset(tiny_tokenizer(96), convs, max_length=16)  # raises at the call, not on first next()


def test_dataset_without_assistant_turn_fails_before_iterating():
    convs = [long_prompt("a", 2), Conversation("b", [{"role": "user", "content": "t5"}])]
    with pytest.raises(DataError, match="conversation 'b' has no assistant turn"):
        tokenize_dataset(tiny_tokenizer(96), convs, max_length=16)


def test_dataset_skips_fully_masked_samples_and_says_so(capsys):
    convs = [long_prompt("a", 2), long_prompt("b", 40), long_prompt("c", 3)]
    samples = list(tokenize_dataset(tiny_tokenizer(96), convs, max_length=16))
    assert [s[0] for s in samples] == ["a", "c"]
    assert all(any(mask) and len(ids) == len(mask) <= 16 for _, ids, mask in samples)
    assert "skipped 1 of 3 conversations with no assistant token in their first 16 tokens: 'b'" in (
        capsys.readouterr().err
    )
