"""Turn conversations into token ids and a loss mask with the target's own chat template.

The mask is 1 on the tokens the target writes as the assistant (each assistant message's content and the single
token that ends its turn, e.g. SmolLM2's `<|im_end|>`), 0 on everything the target reads: system, user and tool
turns and the template's `<|im_start|>assistant\\n` headers. A wrong mask is the most common cause of a useless
drafter, so the spans come from the template itself rather than from hand-written patterns:

- the content of assistant message i starts where `render(messages[:i], add_generation_prompt=True)` ends and its
  turn ends where `render(messages[:i + 1])` ends; both must be prefixes of the full rendering (a template that
  renders earlier turns differently once later turns exist is refused, since no prefix then marks the turn);
- the text the template puts after the content (`<|im_end|>\\n`) is found by rendering the turn with empty content;
  only its first token, the one the model emits to stop, is learned. If a template rewrites content (strips it,
  drops reasoning) so that the empty rendering does not line up, the whole rest of the turn is learned instead;
- characters map to tokens through the fast tokenizer's offsets: a token is in the mask if it overlaps the span.

Tokenizers without a chat template (tiny test models, base models) use a plain rendering, one line per message:
`role: content`, with the EOS token right after each assistant content and `assistant: ` as the generation prompt.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from jinja2 import TemplateError
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from draftsmith.data.sources import Conversation, Message
from draftsmith.errors import ConfigError, DataError

_NO_ASSISTANT_HINT = (
    "a training sample needs at least one assistant reply to learn from; run `draftsmith data --regenerate` to have "
    "the target write the replies, or drop conversations without one"
)
console = Console(stderr=True, soft_wrap=True)


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], add_generation_prompt: bool = False
) -> str:
    """The conversation as text, exactly as the target sees it (chat template, or the plain fallback without one)."""
    if tokenizer.chat_template is None:
        eos = tokenizer.eos_token or ""
        lines = [f"{m['role']}: {m['content']}{eos if m['role'] == 'assistant' else ''}\n" for m in messages]
        return "".join(lines) + ("assistant: " if add_generation_prompt else "")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[int]:
    """Prompt token ids for a chat, ending with the assistant's generation prompt, rendered as in training."""
    text = render_chat(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], max_length: int, *, conv_id: str = "?"
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation, cut to the first `max_length` tokens.

    `conv_id` names the conversation in errors: no assistant turn, a template that fails or is not prefix-stable.
    """
    if max_length < 1:
        raise ConfigError(f"max_length must be at least 1, found {max_length}", hint="pass a positive --max-length")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"conversation {conv_id!r} has no assistant turn", hint=_NO_ASSISTANT_HINT)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} is not a fast tokenizer, so it cannot map text to tokens",
            hint="the loss mask needs character offsets; load the target with a `tokenizer.json` (fast) tokenizer",
        )
    full = _render(tokenizer, messages, False, conv_id)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(encoding["input_ids"])[:max_length]
    offsets: list[tuple[int, int]] = list(encoding["offset_mapping"])[:max_length]
    # Turns that start past the kept tokens cannot reach the mask: rendering their prefixes would only cost time
    # (each rendering is as long as the conversation so far, so all of them grow with the square of its length).
    kept_chars = offsets[-1][1] if len(encoding["input_ids"]) > max_length else len(full)
    starts = [s for s, _ in offsets]
    mask = [0] * len(ids)
    for content_start, content_end, turn_end in _assistant_spans(tokenizer, messages, full, conv_id, kept_chars):
        for t, (s, e) in enumerate(offsets):
            if s < content_end and e > content_start:
                mask[t] = 1
        stop = bisect_left(starts, content_end)  # the first token after the content: the one that ends the turn
        if stop < len(ids) and starts[stop] < turn_end:
            mask[stop] = 1
    return ids, mask


def _assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], full: str, conv_id: str, kept_chars: int
) -> Iterator[tuple[int, int, int]]:
    """(content start, content end, turn end) character offsets in `full` for each assistant message that starts
    within the first `kept_chars` characters."""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _prefix_end(_render(tokenizer, messages[:i], True, conv_id), full, conv_id, i, "generation prompt")
        if start >= kept_chars:
            return
        end = _prefix_end(_render(tokenizer, messages[: i + 1], False, conv_id), full, conv_id, i + 1, "messages")
        empty = _render(tokenizer, [*messages[:i], {"role": "assistant", "content": ""}], False, conv_id)
        after = empty[start:]  # what the template writes after an assistant content, e.g. "<|im_end|>\n"
        lined_up = empty.startswith(full[:start]) and full[start:end].endswith(after) and end - len(after) >= start
        yield start, end - len(after) if lined_up else end, end


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], gen_prompt: bool, conv_id: str) -> str:
    try:
        return render_chat(tokenizer, messages, gen_prompt)
    except TemplateError as e:
        raise DataError(
            f"conversation {conv_id!r}: the chat template of {tokenizer.name_or_path!r} refused it: {e}",
            hint="fix the conversation's roles and order to what the template expects (e.g. alternating user and "
            "assistant turns), or drop it",
        ) from e


def _prefix_end(prefix: str, full: str, conv_id: str, n: int, what: str) -> int:
    if not full.startswith(prefix):
        raise DataError(
            f"conversation {conv_id!r}: the chat template is not prefix-stable: rendering its first {n} {what} "
            "gives text that is not a prefix of the whole conversation, so assistant turns cannot be located",
            hint="use a chat template that renders earlier turns the same way whatever follows them, "
            "or drop this conversation",
        )
    return len(prefix)


def tokenize_dataset(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Conversation], max_length: int
) -> Iterator[tuple[str, list[int], list[int]]]:
    """(id, input_ids, loss_mask) for each conversation, checked before the caller starts any long work.

    Raises at once (not on first iteration) when a conversation has no assistant turn or when no conversation keeps
    a single assistant token within `max_length`. A conversation whose assistant tokens all fall after
    `max_length` teaches nothing, so it is skipped, and the skipped ids are reported when iteration ends.
    """
    for conv in conversations:
        if not any(m["role"] == "assistant" for m in conv.messages):
            raise DataError(f"conversation {conv.id!r} has no assistant turn", hint=_NO_ASSISTANT_HINT)
    first = next(
        (c for c in conversations if any(tokenize_conversation(tokenizer, c.messages, max_length, conv_id=c.id)[1])),
        None,
    )
    if first is None:
        raise DataError(
            f"all {len(conversations)} conversations have every token masked out: no assistant token falls within "
            f"the first {max_length} tokens of any of them",
            hint="raise --max-length, or check that the data's assistant turns are not empty",
        )
    return _tokenize_all(tokenizer, conversations, max_length)


def _tokenize_all(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Conversation], max_length: int
) -> Iterator[tuple[str, list[int], list[int]]]:
    skipped: list[str] = []
    for conv in conversations:
        ids, mask = tokenize_conversation(tokenizer, conv.messages, max_length, conv_id=conv.id)
        if any(mask):
            yield conv.id, ids, mask
        else:
            skipped.append(conv.id)
    if skipped:
        console.print(
            f"[yellow]warning:[/] skipped {len(skipped)} of {len(conversations)} conversations with no assistant "
            f"token in their first {max_length} tokens: {', '.join(map(repr, skipped[:5]))}"
            f"{', ...' if len(skipped) > 5 else ''}",
            highlight=False,
        )


def render_mask(tokenizer: PreTrainedTokenizerBase, ids: list[int], mask: list[int]) -> str:
    """The decoded tokens with every run of learned (masked-in) tokens wrapped in [[ ]], to check a mask by eye."""
    parts: list[str] = []
    run: list[int] = []
    for t, (token, learned) in enumerate(zip(ids, mask, strict=True)):
        run.append(token)
        if t + 1 == len(ids) or mask[t + 1] != learned:
            text = tokenizer.decode(run, skip_special_tokens=False)
            parts.append(f"[[{text}]]" if learned else text)
            run = []
    return "".join(parts)
