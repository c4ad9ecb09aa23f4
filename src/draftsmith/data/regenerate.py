"""Have the target write every assistant turn itself, so the drafter learns the target's own distribution.

System, user and tool turns are kept; original assistant contents are dropped. Each conversation gets an assistant
turn wherever it had one, and after every user message not already answered (so prompt-only data such as MT-bench
style `turns` becomes user/assistant pairs). Turns are written in order: turn i is generated from the conversation
as regenerated so far, exactly as the target would see it at inference.

Regeneration is the slowest data step. On a transformers target it runs in rows that never drain
(`backends/stream.py`): a row that finishes a turn feeds the next prompt's new tokens, one that finishes a
conversation starts the next (after the opening every prompt shares, run once), and with `record` the states of
every token fed are kept, so `extract` needs no second pass. A batch per turn drains instead: its last rows decode
almost alone, and its padded prefill and a cache copy for every finished row cost more the larger the batch (384
prompts in one batch of 384 rows: 127.9 written tokens/s; 1,024 prompts: 503.6 at 128 rows against the stream's
541.6 at 256; bf16, AMX Xeon, measurements log). An engine of its own (vLLM) or a model whose cache the stream
cannot lay out gets one batched generation per turn of a batch of conversations (similar first-prompt lengths share
a batch; `generate_batch` or the engine). Resumable: each finished batch (or group of finished conversations,
states first) is appended to the output JSONL and fsynced; a re-run reads the ids already there, drops a torn last
line, and generates only the rest. Each regenerated turn records `"truncated": true` when it was cut at
`max_new_tokens` instead of ending with the target's EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from draftsmith.backends.batch import batched_attention, choose, generate_batch, pad_id
from draftsmith.backends.hf import TransformersBackend
from draftsmith.backends.stream import StreamDecoder, streamable
from draftsmith.data.sources import Conversation, Message
from draftsmith.data.tokenize import render_chat
from draftsmith.errors import ConfigError, DataError
from draftsmith.progress import progress_bar
from draftsmith.store import RecordedSample, Recording, write_recorded
from draftsmith.target import Target

if TYPE_CHECKING:
    from draftsmith.backends import Backend

console = Console(stderr=True, soft_wrap=True)


def regenerate(
    target: Target,
    conversations: Sequence[Conversation],
    out_path: Path,
    *,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    progress: bool = True,
    backend: Backend | None = None,
    record: Recording | None = None,
) -> Path:
    """Write `out_path` (JSONL: {"id", "messages"}) with every assistant turn written by `target`; resumes.

    `backend` runs the generation (default: `target` itself; see `draftsmith.backends`). `record`: keep the hidden
    states of every conversation as it is written, in `recorded_dir(out_path)`, for `extract` to copy (the stream
    only: an engine of its own does not hand them out)."""
    if batch_size < 1 or max_new_tokens < 1:
        raise ConfigError(
            f"batch_size and max_new_tokens must be at least 1, found {batch_size} and {max_new_tokens}",
            hint="pass positive --batch-size and --max-new-tokens",
        )
    out_path = Path(out_path)
    check_unique_ids(conversations)
    plans = {c.id: _plan(c) for c in conversations}
    done = read_done_ids(out_path)
    pending = [c.id for c in conversations if c.id not in done]
    first = {cid: _encode_prompt(target, plans[cid][: plans[cid].index(None)]) for cid in pending}
    too_long = [cid for cid in pending if len(first[cid]) + max_new_tokens > target.context_length]
    if too_long:
        raise DataError(
            f"{len(too_long)} conversations (first {too_long[0]!r}) have a first prompt of {len(first[too_long[0]])} "
            f"tokens, which with {max_new_tokens} new tokens exceeds the context of {target.name} "
            f"({target.context_length} tokens)",
            hint="lower --max-new-tokens or drop the longest conversations",
        )
    pending.sort(key=lambda cid: len(first[cid]))  # similar prompt lengths share a batch: less padding

    stats = _Stats()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    engine = backend.target if isinstance(backend, TransformersBackend) else target if backend is None else None
    with (
        progress_bar(*columns, console=console, disable=not progress) as bar,
        out_path.open("a", encoding="utf-8") as out,
    ):
        task = bar.add_task("regenerate", total=len(conversations), completed=len(conversations) - len(pending))
        if pending and engine is not None and streamable(engine.model):

            def advance() -> None:
                bar.update(task, advance=1, description=f"regenerate ({stats.tokens_per_s:.0f} tokens/s)")

            with _Output(out, len(done), batch_size, recorded_dir(out_path), record, advance) as output:
                torch.manual_seed(_batch_seed(seed, pending))
                _regenerate_stream(
                    engine, pending, plans, temperature, max_new_tokens, batch_size, stats, output.add, record,
                    common_prefix(list(first.values())),
                )  # fmt: skip
        else:  # an engine of its own (vLLM) batches inside: hand it one turn of a batch of conversations at a time
            for start in range(0, len(pending), batch_size):
                ids = pending[start : start + batch_size]
                batch_seed = _batch_seed(seed, ids)
                torch.manual_seed(batch_seed)
                records = _regenerate_batch(target, ids, plans, temperature, max_new_tokens, stats, backend, batch_seed)
                out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
                out.flush()
                os.fsync(out.fileno())
                bar.update(task, advance=len(ids), description=f"regenerate ({stats.tokens_per_s:.0f} tokens/s)")
    if pending:
        console.print(
            f"regenerated {len(pending)} conversations ({stats.turns} turns, {stats.truncated} cut at "
            f"max_new_tokens={max_new_tokens}): {stats.tokens} tokens in {stats.seconds:.1f}s = "
            f"{stats.tokens_per_s:.1f} tokens/s",
            highlight=False,
        )
    if stats.cut:
        console.print(
            f"[yellow]warning:[/] {stats.cut} conversations ended early: their next prompt would not fit the "
            f"context of {target.name} ({target.context_length} tokens)",
            highlight=False,
        )
    return out_path


def check_unique_ids(conversations: Sequence[Conversation]) -> None:
    """Ids key resumption (done or not) and every later stage's samples, so a repeated id is refused up front."""
    seen: set[str] = set()
    for conv in conversations:
        if conv.id in seen:
            raise DataError(
                f"conversation id {conv.id!r} occurs more than once", hint="give every conversation a unique id"
            )
        seen.add(conv.id)


class _Stats:
    """Running totals for the progress bar and the closing summary."""

    def __init__(self) -> None:
        self.tokens = self.turns = self.truncated = self.cut = 0
        self.seconds = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _plan(conv: Conversation) -> list[Message | None]:
    """The conversation with None at each assistant turn to write: where it had one, and after unanswered users."""
    plan: list[Message | None] = []
    for i, message in enumerate(conv.messages):
        if message["role"] == "assistant":
            plan.append(None)
            continue
        plan.append(message)
        following = conv.messages[i + 1]["role"] if i + 1 < len(conv.messages) else None
        if message["role"] == "user" and following != "assistant":
            plan.append(None)
    if None not in plan:
        raise DataError(
            f"conversation {conv.id!r} has no user or assistant turn to answer (roles: "
            f"{[m['role'] for m in conv.messages]})",
            hint="each conversation needs at least one user message",
        )
    return plan


def common_prefix(prompts: Sequence[list[int]]) -> list[int]:
    """The tokens every prompt opens with (a chat template's default system prompt), leaving each prompt at least
    one token of its own."""
    if not prompts:
        return []
    shortest = min(map(len, prompts)) - 1
    first = prompts[0][:shortest]
    end = next((i for i, token in enumerate(first) if any(p[i] != token for p in prompts)), len(first))
    return first[:end]


def _encode_prompt(target: Target, history: list[Message], generation_prompt: bool = True) -> list[int]:
    text = render_chat(target.tokenizer, history, add_generation_prompt=generation_prompt)
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def _batch_seed(seed: int, ids: list[str]) -> int:
    """A seed from the run's seed and the batch's ids, so a batch samples the same way however the run got there."""
    digest = hashlib.sha256("\n".join([str(seed), *ids]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _regenerate_batch(
    target: Target,
    ids: list[str],
    plans: dict[str, list[Message | None]],
    temperature: float,
    max_new_tokens: int,
    stats: _Stats,
    backend: Backend | None = None,
    seed: int = 0,
) -> list[dict]:
    """Regenerate a batch of conversations turn by turn: one batched `generate` per turn index."""
    written: dict[str, list[dict]] = {cid: [] for cid in ids}
    position = dict.fromkeys(ids, 0)
    active = list(ids)
    stop_ids = target.eos_token_ids
    turn = 0
    while active:
        waiting, prompts = [], []
        for cid in active:
            plan, messages = plans[cid], written[cid]
            while position[cid] < len(plan) and plan[position[cid]] is not None:
                messages.append(dict(plan[position[cid]]))
                position[cid] += 1
            if position[cid] == len(plan):
                continue
            prompt = _encode_prompt(target, messages)
            if len(prompt) + max_new_tokens > target.context_length:
                stats.cut += 1  # a later turn outgrew the context: keep the turns written so far
                continue
            waiting.append(cid)
            prompts.append(prompt)
        if not waiting:
            break
        start = time.perf_counter()
        options = {"temperature": temperature, "max_new_tokens": max_new_tokens, "stop_ids": stop_ids}
        if backend is None:
            outputs = generate_batch(target, prompts, **options)
        else:  # an engine with its own RNG gets a seed per batch and turn (turn i of a batch: seed + 65537 i)
            outputs = backend.generate(prompts, seed=seed + 65_537 * turn, **options)
        turn += 1
        stats.seconds += time.perf_counter() - start
        for cid, (tokens, ended) in zip(waiting, outputs, strict=True):
            text = target.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            written[cid].append({"role": "assistant", "content": text, "truncated": not ended})
            position[cid] += 1
            stats.tokens += len(tokens) + ended
            stats.turns += 1
            stats.truncated += not ended
        active = waiting
    return [{"id": cid, "messages": written[cid]} for cid in ids]


class _Output:
    """Finished conversations on their way to `out` in groups of `group`, each group's states file written first
    (`write_recorded`, named by the group's first line in `out`): a conversation on disk always has its states on
    disk, and a crash loses at most a group."""

    def __init__(self, out, written: int, group: int, folder: Path, record: Recording, advance: Callable) -> None:
        self.out, self.written, self.group, self.folder, self.record, self.advance = (
            out, written, group, folder, record, advance
        )  # fmt: skip
        self.pending: list[tuple[dict, RecordedSample | None]] = []

    def __enter__(self) -> _Output:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.flush()

    def add(self, record: dict, sample: RecordedSample | None) -> None:
        self.pending.append((record, sample))
        if len(self.pending) >= self.group:
            self.flush()

    def flush(self) -> None:
        samples = [sample for _, sample in self.pending if sample is not None]
        if samples:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_recorded(self.folder / f"part-{self.written:07d}.safetensors", samples, self.record)
        self.out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r, _ in self.pending))
        self.out.flush()
        os.fsync(self.out.fileno())
        for _ in self.pending:
            self.advance()
        self.written += len(self.pending)
        self.pending = []


class _Job:
    """One conversation in a stream row: its turns so far, the reply in progress, the tokens the row has fed since it
    last restarted (what its KV cache holds: with their loss mask and, when recording, their states) and the tokens
    it must feed before it writes again (each with its loss-mask bit)."""

    def __init__(self, cid: str, plan: list[Message | None]) -> None:
        self.cid, self.plan, self.at = cid, plan, 0
        self.messages: list[dict] = []
        self.reply: list[int] = []
        self.fed: list[int] = []
        self.mask: list[int] = []
        self.forced: deque[tuple[int, int]] = deque()
        self.states: list[tuple[torch.Tensor, ...]] = []  # (aux, last, top) of the fed tokens, in chunks
        self.recordable = True  # False once the row restarted on a re-tokenised history (its mask is not ours)
        self.done = False

    def next_prompt(self, target: Target, max_new_tokens: int, stats: _Stats) -> list[int] | None:
        """The prompt of the next assistant turn (the plan's messages before it copied in), or None when the
        conversation is done or its next prompt would not fit the context (counted in `stats.cut`)."""
        while self.at < len(self.plan) and self.plan[self.at] is not None:
            self.messages.append(dict(self.plan[self.at]))
            self.at += 1
        if self.at == len(self.plan):
            return None
        prompt = _encode_prompt(target, self.messages)
        if len(prompt) + max_new_tokens > target.context_length:
            stats.cut += 1  # a later turn outgrew the context: keep the turns written so far
            return None
        return prompt

    def write(self, token: int, stop_ids: set[int], max_new_tokens: int) -> bool:
        """Whether the turn goes on: `token` joins the reply (and is fed next) unless it is a stop token; False when
        the turn is over (a stop token, or the reply is `max_new_tokens` long with it)."""
        if token in stop_ids:
            return False
        self.reply.append(token)
        if len(self.reply) < max_new_tokens:
            self.forced.append((token, 1))
            return True
        return False

    def turn_over(self, target: Target, token: int, max_new_tokens: int, stats: _Stats) -> bool:
        """The turn ended at `token` (a stop token, or the reply's last): note it and queue what the row feeds next:
        the next prompt's new tokens, or the whole prompt when the history re-tokenises differently (True: the row
        must restart). When the conversation is over (`done`), the tokens that end the last reply (recorded)."""
        ended = token in target.eos_token_ids
        text = target.tokenizer.decode(self.reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        self.messages.append({"role": "assistant", "content": text, "truncated": not ended})
        self.at += 1
        stats.tokens += len(self.reply) + ended
        stats.turns += 1
        stats.truncated += not ended
        self.reply = []
        prompt = self.next_prompt(target, max_new_tokens, stats)
        self.done = prompt is None
        following = _encode_prompt(target, self.messages, False) if self.done else prompt
        if following is None:
            return False
        held, learned = self.fed, 1 + (not ended)  # the reply's last token when not fed yet, the turn's end token
        if len(following) > len(held) and following[: len(held)] == held:
            tail = following[len(held) :][: learned if self.done else None]
            self.forced.extend((t, int(k < learned)) for k, t in enumerate(tail))
            return False
        if self.done:  # the end re-tokenises differently: the states stop at the last token fed
            return False
        self.fed, self.mask, self.states, self.recordable = [], [], [], False
        self.forced = deque((t, 0) for t in prompt)
        return True

    def skip_prefix(self, prefix: list[int], states: tuple[torch.Tensor, ...] | None) -> bool:
        """Whether the tokens to feed open with `prefix`, whose keys and values (and recorded `states`) the decoder
        holds: they are then counted as fed, and the row starts after them."""
        n = len(prefix)
        if not n or len(self.forced) <= n or [token for token, _ in islice(self.forced, n)] != prefix:
            return False
        for _ in range(n):
            self.feed()
        if states:
            self.states.append(states)
        return True

    def feed(self) -> int:
        token, learned = self.forced.popleft()
        self.fed.append(token)
        self.mask.append(learned)
        return token

    def sample(self) -> RecordedSample | None:
        """(id, tokens, loss mask, aux, last, top) of everything the row fed for this conversation, when recorded."""
        if not (self.states and self.recordable):
            return None
        aux, last, top = (torch.cat(parts) for parts in zip(*self.states, strict=True))
        ids, mask = torch.tensor(self.fed, dtype=torch.int32), torch.tensor(self.mask, dtype=torch.uint8)
        return self.cid, ids, mask, aux, last, top


def _regenerate_stream(
    target: Target,
    pending: list[str],
    plans: dict[str, list[Message | None]],
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    stats: _Stats,
    finish: Callable[[dict, RecordedSample | None], None],
    record: Recording | None,
    prefix: list[int],
) -> None:
    """Regenerate `pending` in `batch_size` rows that never drain (`StreamDecoder`), handing each conversation to
    `finish` as it ends. A row that finishes a turn feeds only the next prompt's new tokens (the template and the
    next user message) when that prompt extends what the row holds, else restarts with the whole prompt; a row that
    finishes a conversation starts the next one. Either way each turn is written from exactly the tokens
    `_regenerate_batch` would prompt it with.

    `record`: the states of every fed token are kept per conversation (`Target.recording`), with the loss mask
    `tokenize` gives (reply tokens and the token after each reply); the row also feeds the tokens that end the
    last reply, so the recorded conversation is `tokenize`'s up to its last learned token.

    `prefix`: tokens that open every prompt, run once; a row starting a prompt that opens with them copies their keys
    and values instead of feeding them (`StreamDecoder.share_prefix`)."""
    queue = deque(pending)

    def next_job() -> _Job | None:
        while queue:
            job = _Job(queue[0], plans[queue.popleft()])
            prompt = job.next_prompt(target, max_new_tokens, stats)
            if prompt is not None:
                job.forced.extend((t, 0) for t in prompt)
                return job
            finish({"id": job.cid, "messages": job.messages}, None)
        return None

    jobs = [job for job in (next_job() for _ in range(min(batch_size, len(queue)))) if job]
    if not jobs:
        return
    first = [[job.feed() for _ in range(len(job.forced))] for job in jobs]  # prefilled together
    began = time.perf_counter()
    recording = target.recording(record.layer_ids) if record else nullcontext([])
    with torch.inference_mode(), batched_attention(target.model), recording as states:
        decoder = StreamDecoder(target, first, max(map(len, first)) + max_new_tokens)
        if states:  # the prefill's, each row's after its left padding (kept in host memory until written)
            for job, prompt, *row in zip(jobs, first, *(t.cpu() for t in states[0]), strict=True):
                job.states.append(tuple(t[-len(prompt) :] for t in row))
        states.clear()
        if prefix:
            decoder.share_prefix(prefix)
        prefix_states = tuple(t[0].cpu() for t in states[0]) if states else None
        pad = pad_id(target)
        while True:
            writing = [i for i, job in enumerate(jobs) if job and not (job.forced or job.done)]
            chosen = dict(zip(writing, choose(decoder.logits[writing], temperature).tolist(), strict=True))
            fresh = [False] * len(jobs)
            for i, job in enumerate(jobs):
                if job is None:
                    continue
                fresh[i] = i in chosen and not job.write(chosen[i], target.eos_token_ids, max_new_tokens)
                fresh[i] = fresh[i] and job.turn_over(target, chosen[i], max_new_tokens, stats)
                if job.done and not job.forced:  # the conversation is over: the row takes the next one, if any
                    finish({"id": job.cid, "messages": job.messages}, job.sample())
                    jobs[i], fresh[i] = next_job(), True
            stats.seconds = time.perf_counter() - began
            busy = [i for i, job in enumerate(jobs) if job]
            if not busy:
                break
            # Dropping rows copies the whole cache (~0.4 s at 256 rows and 800 slots): done once a quarter of the
            # rows idle, not for every row that runs out of conversations.
            if 4 * (len(jobs) - len(busy)) > len(jobs):
                decoder.keep(busy)
                jobs, fresh = [jobs[i] for i in busy], [fresh[i] for i in busy]
            feed, restart, shared = [], [], []
            for i, job in enumerate(jobs):
                if job is None:  # idle until the next compaction: a pad token that starts over every step
                    restart.append(i)
                    feed.append(pad)
                    continue
                if fresh[i]:
                    (shared if job.skip_prefix(prefix, prefix_states) else restart).append(i)
                feed.append(job.feed())
            states.clear()
            decoder.step(feed, restart, shared)
            if states:
                for job, *row in zip(jobs, *(t.cpu() for t in states[0]), strict=True):
                    if job:
                        job.states.append(tuple(row))
    stats.seconds = time.perf_counter() - began


def recorded_dir(path: Path) -> Path:
    """Where the states recorded as the conversations in `path` were written live: `chat.features/` beside
    `chat.jsonl` (`self_chat(..., record=...)`), `regenerated.features/` beside `regenerated.jsonl`."""
    return Path(path).with_suffix(".features")


def read_done_ids(path: Path) -> set[str]:
    """Ids of the conversations already in a regeneration output; a torn last line (a crash mid-write) is cut off.

    A damaged line anywhere else is an error: that file was not written by an interrupted regeneration.
    """
    path = Path(path)
    if not path.exists():
        return set()
    done: set[str] = set()
    good_end = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # the torn tail of a write that never finished
            try:
                done.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(
                    f'{path}:{number}: expected a regenerated conversation ({{"id", "messages"}}), found {line[:60]!r}',
                    hint="this file was not left by an interrupted regeneration; move it away to start over",
                ) from e
            good_end += len(line)
    if good_end < path.stat().st_size:
        console.print(f"{path}: dropping a torn last line left by an interrupted run", highlight=False)
        with path.open("r+b") as f:
            f.truncate(good_end)
    return done
