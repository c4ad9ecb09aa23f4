"""Prompts the target writes itself: the "pre-query template" technique (Magpie, Xu et al. 2024).

An instruction-tuned model that is fed its chat template up to the start of a user turn, with nothing after it,
writes a plausible user message. Those prompts come from the target's own idea of what users ask, cost no dataset,
and spread wider than any single benchmark. The pre-query text is derived from the template itself: render a
conversation whose user message is a placeholder and cut just before the placeholder. Generation stops at the
token that ends a user turn (for SmolLM2 `<|im_end|>`) or at EOS; unfinished, too short, too long and duplicate
prompts (after casefolding and collapsing whitespace) are dropped.

Left alone, a small target asks the same few kinds of things. With `kinds` (the data stage's default: all of
`SYNTH_KINDS`), each prompt is steered towards one kind: the user turn starts with one of several openers of that
kind ("Write a Python function that", "Translate into Spanish:", ...), chosen by a RNG seeded from `seed`, and the
target writes the rest. For the kinds about a given text (extraction, summarisation, questions about a passage) the
target first writes a short passage (a genre and topic drawn from small lists, e.g. "a news article about
gardening"), which the prompt then embeds. Kinds take turns, so the prompts spread evenly across them, and each id
names its kind (`synth-code-00004`; `prompt_kind` reads it back) so an evaluation can report per kind.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from draftsmith.backends.batch import generate_batch
from draftsmith.data.sources import Conversation
from draftsmith.data.tokenize import encode_chat, render_chat
from draftsmith.errors import ConfigError, TargetError
from draftsmith.progress import progress_bar
from draftsmith.target import Target

if TYPE_CHECKING:
    from draftsmith.backends import Backend

_PLACEHOLDER = "DRAFTSMITH_USER_MESSAGE_PLACEHOLDER"
console = Console(stderr=True, soft_wrap=True)


@dataclass(frozen=True)
class Kind:
    """How to steer a synthesised prompt towards one kind of request."""

    openers: tuple[str, ...]  # how the user turn starts; "{passage}" marks where a target-written passage goes
    passage: bool = False  # the target first writes a passage that the opener embeds
    continued: bool = True  # the target writes the rest of the prompt after the opener (False: the opener is whole)


KINDS: dict[str, Kind] = {
    "writing": Kind((
        "Write a short story about", "Write a poem about", "Write a blog post about", "Write an email to",
        "Write a product description for", "Write a speech for",
    )),
    "roleplay": Kind((
        "Let's play a game. You are", "Pretend you are", "I want you to act as", "Role-play as",
        "Imagine you are a character in", "Stay in character as",
    )),
    "reasoning": Kind((
        "Explain step by step why", "What would happen if", "Compare the pros and cons of", "Solve this riddle:",
        "If all", "Which is the better choice and why:",
    )),
    "math": Kind((
        "Solve for x:", "Calculate", "A train travels", "What is the probability that", "Find the derivative of",
        "A shop sells",
    )),
    # Questions that ask the target what it knows (MT-bench's STEM and humanities): the kind a drafter trained
    # without it accepted least of on MT-bench (first draft token 0.44 / 0.51 against 0.52-0.65 for the rest).
    "knowledge": Kind((
        "Explain how", "What is the difference between", "Why do", "Describe the history of",
        "What are the main causes of", "Explain the concept of", "What role did", "How does",
    )),
    "code": Kind((
        "Write a Python function that", "Write a JavaScript function to", "Write a SQL query that",
        "Explain what this Python code does:\n```python\n", "Write a bash script that", "How do I use Python to",
    )),
    "extraction": Kind(
        (
            "Extract all the names, dates and places mentioned in the text below.\n\n{passage}",
            "List the key facts in the following text as bullet points.\n\n{passage}",
            "{passage}\n\nWhich people, organisations and places does the text above mention? Answer as a list.",
            "From the text below, extract every number and what it refers to, as JSON.\n\n{passage}",
        ),
        passage=True,
        continued=False,
    ),
    "translation": Kind((
        "Translate the following sentence into French:", "Translate into Spanish:", "How do you say this in German:",
        "Translate this paragraph into Italian:", "What is the English for", "Translate into Portuguese:",
    )),
    "summarisation": Kind(
        (
            "Summarize the following text in two sentences.\n\n{passage}",
            "{passage}\n\nSummarize the text above in one paragraph.",
            "Give a short title and a one-sentence summary for this text:\n\n{passage}",
            "Write a TL;DR of the text below.\n\n{passage}",
        ),
        passage=True,
        continued=False,
    ),
    "passage_qa": Kind(
        (
            "Read the passage below, then answer the question.\n\nPassage: {passage}\n\nQuestion:",
            "{passage}\n\nBased on the text above,",
            "Here is a text:\n\n{passage}\n\nAnswer this question about it:",
        ),
        passage=True,
    ),
}  # fmt: skip
SYNTH_KINDS: tuple[str, ...] = tuple(KINDS)
_GENRES = (
    "news article", "encyclopedia entry", "email", "product review", "short story", "report", "biography",
    "recipe", "diary entry", "press release",
)  # fmt: skip
_TOPICS = (
    "a local election", "gardening", "a new smartphone", "the history of a small town", "climate change",
    "a football match", "a cooking class", "a trip to Japan", "a software company", "a scientific discovery",
    "a famous painter", "healthy sleep", "a museum opening", "electric cars", "a school fundraiser", "the ocean",
)  # fmt: skip


def check_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    """The kinds as a tuple, or a ConfigError naming the unknown ones and listing the valid kinds."""
    if isinstance(kinds, str):
        kinds = [kinds]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ConfigError(
            f"unknown prompt kind{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}: expected some of "
            f"{', '.join(SYNTH_KINDS)}",
            hint="fix synth_kinds (on the command line: --synth-kinds writing,code,...)",
        )
    if len(set(kinds)) < len(kinds):
        raise ConfigError(f"synth_kinds lists a kind twice: {list(kinds)}", hint="name each kind once")
    return tuple(kinds)


def prompt_kind(conv_id: str) -> str | None:
    """The kind of a prompt synthesised with kinds, read from its id (`synth-code-00004` -> "code"), else None."""
    parts = conv_id.rsplit("/", 1)[-1].split("-")
    return parts[1] if len(parts) == 3 and parts[0] == "synth" and parts[1] in KINDS else None


def pre_query(target: Target) -> tuple[str, set[int]]:
    """(the template's text up to where a user message starts, the token ids that end a user message)."""
    tokenizer = target.tokenizer
    rendered = render_chat(tokenizer, [{"role": "user", "content": _PLACEHOLDER}])
    if _PLACEHOLDER not in rendered:
        raise TargetError(
            f"the chat template of {target.name} does not show a user message verbatim, so the pre-query text "
            "cannot be derived from it",
            hint="use sources with prompts instead of --synth for this target",
        )
    prefix = rendered[: rendered.index(_PLACEHOLDER)]
    # The first token the template writes after a user message is the one that ends it, e.g. "<|im_end|>".
    after = render_chat(tokenizer, [{"role": "user", "content": ""}])[len(prefix) :]
    end_of_turn = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    return prefix, target.eos_token_ids | set(end_of_turn)


def synthesize_prompts(
    target: Target,
    n: int,
    *,
    seed: int,
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    min_chars: int = 16,
    max_chars: int = 1000,
    batch_size: int = 16,
    max_attempts: int | None = None,
    kinds: Sequence[str] | None = None,
    progress: bool = True,
    backend: Backend | None = None,
) -> list[Conversation]:
    """Up to `n` distinct user prompts written by the target, as one-message conversations.

    Without `kinds` (None or empty) the prompts are plain pre-query samples, ids `synth-00000`, ...; with `kinds`,
    n is split evenly across them (the first n % len(kinds) kinds get one more), each prompt is steered towards
    its kind (see `KINDS`), and ids name it: `synth-writing-00000`, `synth-roleplay-00001`, ..., the kinds taking
    turns in the order given. Samples at most `max_attempts` (default 5 * n) prompts; with fewer than `n` kept
    after that, warns and returns what it has.
    """
    if temperature <= 0:
        raise ConfigError(
            f"synthesising prompts needs sampling, found temperature {temperature}",
            hint="use a temperature above 0 (1.0 is usual): at 0 every sample is the same prompt",
        )
    if n < 0 or batch_size < 1 or max_new_tokens < 1:
        raise ConfigError(
            f"expected n >= 0, batch_size >= 1 and max_new_tokens >= 1, found {n}, {batch_size}, {max_new_tokens}",
            hint="fix the synth settings",
        )
    steered = check_kinds(kinds) if kinds else ()
    names: tuple[str | None, ...] = steered or (None,)
    quota = {k: n // len(names) + (i < n % len(names)) for i, k in enumerate(names)}
    max_attempts = 5 * n if max_attempts is None else max_attempts
    prefix, stop_ids = pre_query(target)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kept: dict[str, str] = {}  # normalised text -> text, in the order written
    by_kind: dict[str | None, list[str]] = {k: [] for k in names}
    attempts = unfinished = bad_length = duplicates = empty = 0
    options = {"temperature": temperature, "max_new_tokens": max_new_tokens, "stop_ids": stop_ids}

    def generate(prompts: list[list[int]], stream: int) -> list[tuple[list[int], bool]]:
        if backend is None:
            return generate_batch(target, prompts, **options)
        # An engine with its own RNG: prompt sample k of the run gets seed + k, the passage of sample k another.
        return backend.generate(prompts, seed=seed + stream * 2**40 + attempts, **options)

    def decode(tokens: list[int]) -> str:
        return target.tokenizer.decode(tokens, skip_special_tokens=True)

    with progress_bar(console=console, disable=not progress) as bar:
        task = bar.add_task("synthesise prompts", total=n)
        while len(kept) < n and attempts < max_attempts:
            wanting = [k for k in names if len(by_kind[k]) < quota[k]]
            size = min(batch_size, max_attempts - attempts)
            slots = [wanting[i % len(wanting)] for i in range(size)]  # kinds still short take turns
            openers = [rng.choice(KINDS[k].openers) if k else "" for k in slots]
            passages: list[str | None] = [None] * size
            asks = {i: _passage_request(rng) for i, k in enumerate(slots) if k and KINDS[k].passage}
            if asks:
                written = generate(
                    [encode_chat(target.tokenizer, [{"role": "user", "content": a}]) for a in asks.values()], 1
                )
                for i, (tokens, ended) in zip(asks, written, strict=True):
                    passages[i] = decode(tokens).strip() if ended else None
                    unfinished += not ended
                    empty += ended and not passages[i]
            starts = {
                i: openers[i].replace("{passage}", passages[i] or "")
                for i, k in enumerate(slots)
                if not (k and KINDS[k].passage and not passages[i])  # no passage (cut or empty): no prompt
            }
            continued = [i for i in starts if not slots[i] or KINDS[slots[i]].continued]
            asked = {i: _encode(target, prefix + starts[i]) for i in continued}
            outputs = generate(list(asked.values()), 0) if continued else []
            texts: dict[int, str | None] = {i: starts[i].strip() for i in starts if i not in continued}
            for i, (tokens, ended) in zip(continued, outputs, strict=False):
                rest = _continuation(target, asked[i], tokens) if openers[i] else decode(tokens)
                if not ended:
                    unfinished += 1
                    texts[i] = None
                elif openers[i] and not rest.strip():
                    empty += 1
                    texts[i] = None
                else:
                    texts[i] = (starts[i] + rest).strip()
            attempts += size
            for i in sorted(texts):
                text, kind = texts[i], slots[i]
                if text is None:
                    continue
                key = " ".join(text.casefold().split())
                if not min_chars <= len(text) <= max_chars:
                    bad_length += 1
                elif key in kept:
                    duplicates += 1
                elif len(by_kind[kind]) < quota[kind]:
                    kept[key] = text
                    by_kind[kind].append(text)
            bar.update(task, completed=len(kept))
    if len(kept) < n:
        short = [f"{k}: {len(by_kind[k])} of {quota[k]}" for k in steered if len(by_kind[k]) < quota[k]]
        console.print(
            f"[yellow]warning:[/] synthesised {len(kept)} of {n} prompts in {attempts} samples ({unfinished} "
            f"unfinished at {max_new_tokens} tokens, {bad_length} outside {min_chars}-{max_chars} characters, "
            f"{duplicates} duplicates{f', {empty} empty' if empty else ''})"
            + (f"; short of: {', '.join(short)}" if short else ""),
            highlight=False,
        )
    if not steered:
        return [Conversation(f"synth-{i:05d}", [{"role": "user", "content": t}]) for i, t in enumerate(by_kind[None])]
    turns = [(k, done[j]) for j in range(max(quota.values())) for k, done in by_kind.items() if j < len(done)]
    return [Conversation(f"synth-{k}-{i:05d}", [{"role": "user", "content": t}], k) for i, (k, t) in enumerate(turns)]


def _passage_request(rng: random.Random) -> str:
    return f"Write a short {rng.choice(_GENRES)} about {rng.choice(_TOPICS)}."


def _encode(target: Target, text: str) -> list[int]:
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def _continuation(target: Target, prompt: list[int], tokens: list[int]) -> str:
    """The text `tokens` add after `prompt`, with the space a tokenizer puts between them (SentencePiece drops the
    leading space of a fragment decoded alone, which would glue "about" to the next word)."""
    tokenizer = target.tokenizer
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    after = tokenizer.decode(prompt + tokens, skip_special_tokens=True)
    return after[len(before) :] if after.startswith(before) else tokenizer.decode(tokens, skip_special_tokens=True)
