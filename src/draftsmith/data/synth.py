"""Prompts the target writes itself: the "pre-query template" technique (Magpie, Xu et al. 2024).

An instruction-tuned model that is fed its chat template up to the start of a user turn, with nothing after it,
writes a plausible user message. Those prompts come from the target's own idea of what users ask, cost no dataset,
and spread wider than any single benchmark. The pre-query text is derived from the template itself: render a
conversation whose user message is a placeholder and cut just before the placeholder. Generation stops at the
token that ends a user turn (for SmolLM2 `<|im_end|>`) or at EOS; unfinished, too short, too long and duplicate
prompts (after casefolding and collapsing whitespace) are dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from rich.console import Console

from draftsmith.data.regenerate import generate_batch
from draftsmith.data.sources import Conversation
from draftsmith.data.tokenize import render_chat
from draftsmith.errors import ConfigError, TargetError
from draftsmith.progress import progress_bar
from draftsmith.target import Target

if TYPE_CHECKING:
    from draftsmith.backends import Backend

_PLACEHOLDER = "DRAFTSMITH_USER_MESSAGE_PLACEHOLDER"
console = Console(stderr=True, soft_wrap=True)


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
    progress: bool = True,
    backend: Backend | None = None,
) -> list[Conversation]:
    """Up to `n` distinct user prompts written by the target, as one-message conversations `synth-00000`, ...

    Samples at most `max_attempts` (default 5 * n) messages; with fewer than `n` kept after that, warns and
    returns what it has.
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
    max_attempts = 5 * n if max_attempts is None else max_attempts
    prefix, stop_ids = pre_query(target)
    prompt = target.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    torch.manual_seed(seed)
    kept: dict[str, str] = {}  # normalised text -> text, in the order written
    attempts = unfinished = bad_length = duplicates = 0
    with progress_bar(console=console, disable=not progress) as bar:
        task = bar.add_task("synthesise prompts", total=n)
        while len(kept) < n and attempts < max_attempts:
            size = min(batch_size, max_attempts - attempts)
            options = {"temperature": temperature, "max_new_tokens": max_new_tokens, "stop_ids": stop_ids}
            if backend is None:
                outputs = generate_batch(target, [prompt] * size, **options)
            else:  # an engine with its own RNG: sample k of the run gets seed + k
                outputs = backend.generate([prompt] * size, seed=seed + attempts, **options)
            attempts += size
            for tokens, ended in outputs:
                text = target.tokenizer.decode(tokens, skip_special_tokens=True).strip()
                key = " ".join(text.casefold().split())
                if not ended:
                    unfinished += 1
                elif not min_chars <= len(text) <= max_chars:
                    bad_length += 1
                elif key in kept:
                    duplicates += 1
                elif len(kept) < n:
                    kept[key] = text
            bar.update(task, completed=len(kept))
    if len(kept) < n:
        console.print(
            f"[yellow]warning:[/] synthesised {len(kept)} of {n} prompts in {attempts} samples ({unfinished} "
            f"unfinished at {max_new_tokens} tokens, {bad_length} outside {min_chars}-{max_chars} characters, "
            f"{duplicates} duplicates)",
            highlight=False,
        )
    return [Conversation(f"synth-{i:05d}", [{"role": "user", "content": t}]) for i, t in enumerate(kept.values())]
