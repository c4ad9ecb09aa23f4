"""Conversations the target writes both sides of ("self-chat"), in one batch that never drains.

Synthesising a prompt and then regenerating its reply costs two batched generations whose rows leave as they
finish: the last few rows of every batch decode almost alone, and on a CPU a decode step over 2 rows costs nearly
what one over 32 does. Here each row is a whole multi-turn chat: the target writes a user message (sampled, steered
towards one of `SYNTH_KINDS` by an opener, as in `synth`), its own reply (greedy, as served), then the next user
message (free, in the Magpie multi-turn way) and so on, until the row holds `length` tokens. The chat template's
separators between turns are fed as forced tokens when a turn ends, so every row is busy on every step, and every
token of the chat, both sides, is the target's own writing.

For the kinds about a given text, the first user turn asks for a passage ("Write a short news article about
gardening.") and the second turn asks about it ("Summarize the text above in two sentences."), so summarisation,
extraction and questions about a passage come out of the target's own texts.

Output: `chat.jsonl` in the data directory, one {"id", "messages", "kind"} per line, appended and fsynced per batch;
a re-run skips the batches already there (each batch's RNG comes from the seed and its index).

`record` (a `store.Recording`): every token of a chat passes through the target exactly once, in the prefill or in
one decode step, so the hidden states `extract` would compute are there as the chats are written. They are kept,
one file a batch in `recorded_dir(out_path)` (`chat.features/` beside `chat.jsonl`; written before the batch's
chats), with the tokens exactly as the target wrote them and their loss mask (the reply tokens and the token that
ends each reply, as `tokenize` marks them); `extract` copies them instead of a second pass over the chats
(`store.RecordedFeatures`).

A time budget (`minutes`) makes the data fit a machine instead of a count: the same profile wrote 533 tokens/s on
an AMX Xeon (bf16) and 229 on an AVX2 EPYC (float32). No batch starts that would end past the budget at the mean
batch time so far (the first always runs); the seconds spent are kept beside the chats (`chat.seconds.json`), so a
resumed run spends only what is left. The chats written are always a prefix of the chats a larger budget writes.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from draftsmith.backends.batch import BatchDecoder, batched_attention, choose
from draftsmith.data.regenerate import read_done_ids, recorded_dir
from draftsmith.data.synth import KINDS, _passage_request, check_kinds
from draftsmith.data.tokenize import render_chat
from draftsmith.errors import ConfigError, TargetError
from draftsmith.progress import progress_bar
from draftsmith.store import Recording, write_recorded
from draftsmith.target import Target
from draftsmith.util import write_atomic

console = Console(stderr=True, soft_wrap=True)
_MARKS = ("DRAFTSMITH_U1", "DRAFTSMITH_A1", "DRAFTSMITH_U2")

# The second user turn of the kinds about a passage (the first asked the target to write one).
FOLLOW_UPS: dict[str, tuple[str, ...]] = {
    "extraction": (
        "Extract all the names, dates and places mentioned in the text above.",
        "List the key facts in that text as bullet points.",
        "From that text, extract every number and what it refers to, as JSON.",
    ),
    "summarisation": (
        "Summarize the text above in two sentences.",
        "Write a TL;DR of that text.",
        "Give a short title and a one-sentence summary for the text above.",
    ),
    "passage_qa": ("Based on the text above,", "Answer this question about the text above:", "In that text, why"),
}


@dataclass
class _Row:
    """One chat being written: its finished turns, the turn in progress and the tokens to feed before sampling."""

    kind: str | None
    messages: list[dict] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    role: str = "user"
    forced: list[tuple[int, bool]] = field(default_factory=list)  # (token, part of the turn's text)
    ngrams: set[tuple[int, ...]] = field(default_factory=set)  # the reply's n-grams so far (loop detection)


class Template:
    """The chat template cut at its turn boundaries: where a chat starts, and what sits between two turns."""

    def __init__(self, target: Target) -> None:
        tokenizer = target.tokenizer
        roles = ("user", "assistant", "user")
        text = render_chat(tokenizer, [{"role": r, "content": m} for r, m in zip(roles, _MARKS, strict=True)])
        if not all(m in text for m in _MARKS):
            raise TargetError(
                f"the chat template of {target.name} does not show messages verbatim, so self-chat cannot cut it",
                hint="use --synth and --regenerate for this target instead of --self-chat",
            )
        cuts = [text.index(m) for m in _MARKS]
        encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.start = encode(text[: cuts[0]])
        self.to_assistant = encode(text[cuts[0] + len(_MARKS[0]) : cuts[1]])
        self.to_user = encode(text[cuts[1] + len(_MARKS[1]) : cuts[2]])
        if not (self.start and self.to_assistant and self.to_user):
            raise TargetError(
                f"the chat template of {target.name} writes nothing between turns, so self-chat cannot tell them apart",
                hint="use --synth and --regenerate for this target instead of --self-chat",
            )
        self.ends_user = {self.to_assistant[0]} | target.eos_token_ids
        self.ends_assistant = {self.to_user[0]} | target.eos_token_ids
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.encode = encode


def self_chat(
    target: Target,
    n: int,
    out_path: Path,
    *,
    seed: int,
    length: int = 512,
    batch_size: int = 32,
    max_turn_tokens: int = 256,
    temperature: float = 0.0,
    user_temperature: float = 1.0,
    loop_ngram: int = 0,
    kinds: tuple[str, ...] | list[str] = tuple(KINDS),
    minutes: float | None = None,
    record: Recording | None = None,
    progress: bool = True,
) -> Path:
    """Write `n` self-chats of `length` tokens each (template included) to `out_path`, or as many whole batches of
    them as fit in `minutes`; resumes. Kinds take turns (`chat-code-00004`); an assistant turn longer than
    `max_turn_tokens` is cut and marked `"truncated": true`.

    `loop_ngram` N > 0 also cuts a reply (marked the same) when its next token would repeat one of its earlier
    N-grams: a small target's greedy replies often loop, and every token of a loop is a token of data that teaches
    nothing new (45 % of the first 128 tokens of the demo's replies were trigram copies, 15 % on MT-bench).

    `record`: keep each batch's hidden states in `recorded_dir(out_path)` (module docstring)."""
    bad_budget = minutes is not None and minutes <= 0
    if (
        n < 0
        or batch_size < 1
        or length < 16
        or max_turn_tokens < 1
        or user_temperature <= 0
        or loop_ngram < 0
        or bad_budget
    ):
        raise ConfigError(
            f"self-chat needs n >= 0, batch_size >= 1, length >= 16, max_turn_tokens >= 1, a user temperature "
            f"above 0, loop_ngram >= 0 and a budget above 0 minutes; found {n}, {batch_size}, {length}, "
            f"{max_turn_tokens}, {user_temperature}, {loop_ngram}, {minutes}",
            hint="fix the self_chat settings",
        )
    if length > target.context_length:
        raise ConfigError(
            f"self_chat_length {length} exceeds the context of {target.name} ({target.context_length} tokens)",
            hint=f"use a self_chat_length of at most {target.context_length}",
        )
    kinds = check_kinds(kinds) if kinds else ()
    template = Template(target)
    names = [kinds[i % len(kinds)] if kinds else None for i in range(n)]
    ids = [f"chat-{k}-{i:05d}" if k else f"chat-{i:05d}" for i, k in enumerate(names)]
    done = read_done_ids(out_path)
    timing = Path(out_path).with_suffix(".seconds.json")
    spent = json.loads(timing.read_text()) if timing.exists() else {"seconds": 0.0, "batches": 0}
    tokens = seconds = 0.0
    with progress_bar(console=console, disable=not progress) as bar, Path(out_path).open("a", encoding="utf-8") as out:
        task = bar.add_task("self-chat", total=n, completed=len(done & set(ids)))
        for start in range(0, n, batch_size):
            batch = list(range(start, min(n, start + batch_size)))
            if all(ids[i] in done for i in batch):
                continue
            if minutes is not None and spent["batches"]:
                mean = spent["seconds"] / spent["batches"]
                if spent["seconds"] + mean > 60 * minutes:
                    console.print(
                        f"self-chat: {start} of {n} chats fit the {minutes:g}-minute budget "
                        f"({spent['seconds']:.0f}s spent, {mean:.0f}s a batch)"
                    )
                    break
            began = time.perf_counter()
            rows, written = _write_batch(
                target, template, [names[i] for i in batch], random.Random(f"{seed}/{start}"), length,
                max_turn_tokens, temperature, user_temperature, loop_ngram, record,
            )  # fmt: skip
            if record is not None:
                folder = recorded_dir(out_path)
                folder.mkdir(parents=True, exist_ok=True)
                samples = [(ids[i], *w) for i, w in zip(batch, written, strict=True)]
                write_recorded(folder / f"batch-{start:06d}.safetensors", samples, record)
            took = time.perf_counter() - began
            seconds += took
            tokens += len(batch) * length
            records = [
                {"id": ids[i], "messages": row.messages} | ({"kind": row.kind} if row.kind else {})
                for i, row in zip(batch, rows, strict=True)
            ]
            out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            out.flush()
            os.fsync(out.fileno())
            spent = {"seconds": spent["seconds"] + took, "batches": spent["batches"] + 1}
            write_atomic(timing, json.dumps(spent) + "\n")  # after the chats: a crash between loses a batch's time
            bar.update(task, advance=len(batch), description=f"self-chat ({tokens / seconds:.0f} tokens/s)")
    if seconds:
        console.print(f"self-chat: {tokens:.0f} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tokens/s")
    return Path(out_path)


def _write_batch(
    target: Target,
    template: Template,
    kinds: list[str | None],
    rng: random.Random,
    length: int,
    max_turn_tokens: int,
    temperature: float,
    user_temperature: float,
    loop_ngram: int,
    record: Recording | None = None,
) -> tuple[list[_Row], list[tuple[torch.Tensor, ...]]]:
    """One batch of chats, every row decoded for the same number of steps (no row ever leaves); with `record`, also
    each row's (token ids, loss mask, aux states, final states, the target's argmax) over every token it fed."""
    torch.manual_seed(rng.getrandbits(63))
    rows, prompts = [], []
    for kind in kinds:
        row = _Row(kind)
        opener = _passage_request(rng) if kind and KINDS[kind].passage else _opener(rng, kind)
        turn = template.encode(opener) if opener else []
        if kind and KINDS[kind].passage:  # a whole request: the user turn ends here, the reply is the passage
            row.messages.append({"role": "user", "content": opener})
            row.forced, row.role = [(t, False) for t in template.to_assistant], "assistant"
        else:
            row.turn = list(turn)
        rows.append(row)
        prompts.append(template.start + turn)
    width = max(map(len, prompts))
    steps = max(length - width, 1)
    fed = [list(p) for p in prompts]  # every token the target reads, per row
    learned = [[0] * len(p) for p in prompts]  # 1: the assistant wrote it (a reply token or the one ending a reply)
    recording = target.recording(record.layer_ids) if record else nullcontext([])
    with torch.inference_mode(), batched_attention(target.model), recording as states:
        decoder = BatchDecoder(target, prompts, steps)
        for step in range(steps):
            greedy = choose(decoder.logits, temperature).tolist()
            # Only the rows writing a user message sample: sampling the whole batch (then with multinomial, over 128 x
            # 49k logits) was 40 % of a bf16 step, and a user turn is a fraction of every chat.
            writers = [i for i, row in enumerate(rows) if row.role == "user" and not row.forced]
            sampled = choose(decoder.logits[writers], user_temperature).tolist() if writers else []
            chosen = dict(enumerate(greedy)) | dict(zip(writers, sampled, strict=True))
            replying = [row.role == "assistant" and not row.forced for row in rows]
            feed = [_advance(row, chosen[i], template, rng, max_turn_tokens, loop_ngram) for i, row in enumerate(rows)]
            if step < steps - 1:
                decoder.step(torch.tensor(feed))
                for i, token in enumerate(feed):
                    fed[i].append(token)
                    learned[i].append(int(replying[i]))
    written = []
    if states:  # the prefill's states, then one per decode step: the row's tokens after its left padding
        aux, last, top = (torch.cat(parts, dim=1) for parts in zip(*states, strict=True))
        for i, prompt in enumerate(prompts):
            pad = width - len(prompt)
            ids = torch.tensor(fed[i], dtype=torch.int32)
            written.append(
                (ids, torch.tensor(learned[i], dtype=torch.uint8), aux[i, pad:], last[i, pad:], top[i, pad:])
            )
    for row in rows:  # the turn in progress: a cut reply is kept (marked); a user message without a reply goes
        if row.role == "assistant" and row.turn:
            row.messages.append({"role": "assistant", "content": template.decode(row.turn), "truncated": True})
        elif row.messages and row.messages[-1]["role"] == "user":
            row.messages.pop()
    return rows, written


def _advance(
    row: _Row, chosen: int, template: Template, rng: random.Random, max_turn_tokens: int, loop_ngram: int = 0
) -> int:
    """The token this row feeds next: a forced one if any is queued, else `chosen`, ending the turn on a stop
    token, at the length cap or (replies) before a repeated `loop_ngram`-gram; then the template's separator and
    the next turn's opener are queued."""
    if row.forced:
        token, in_turn = row.forced.pop(0)
        if in_turn:
            row.turn.append(token)
        return token
    ends = template.ends_user if row.role == "user" else template.ends_assistant
    capped = len(row.turn) >= max_turn_tokens or (row.role == "assistant" and _loops(row, chosen, loop_ngram))
    if chosen not in ends and not capped:
        row.turn.append(chosen)
        return chosen
    if row.role == "assistant":
        reply = {"role": "assistant", "content": template.decode(row.turn)}
        row.messages.append(reply | ({"truncated": True} if capped else {}))
        follow = FOLLOW_UPS.get(row.kind or "", ())
        opener = rng.choice(follow) if follow and len(row.messages) == 2 else ""
        row.forced = [(t, False) for t in template.to_user] + [(t, True) for t in template.encode(opener)]
        row.role = "user"
    else:
        row.messages.append({"role": "user", "content": template.decode(row.turn).strip()})
        row.forced = [(t, False) for t in template.to_assistant]
        row.role = "assistant"
    row.turn, row.ngrams = [], set()
    return _advance(row, chosen, template, rng, max_turn_tokens, loop_ngram)


def _loops(row: _Row, chosen: int, n: int) -> bool:
    """Whether `chosen` completes an n-gram the reply in progress already holds (recording it if not)."""
    if n <= 0 or len(row.turn) < n - 1:
        return False
    gram = (*row.turn[len(row.turn) - n + 1 :], chosen)
    if gram in row.ngrams:
        return True
    row.ngrams.add(gram)
    return False


def _opener(rng: random.Random, kind: str | None) -> str:
    return rng.choice(KINDS[kind].openers) if kind else ""
