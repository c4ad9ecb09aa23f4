"""Tokens to text, incrementally: the deltas a stream sends, and where a stop string ends the answer.

Streaming and non-streaming responses both run every token through one `TextStream`, so their texts are equal by
construction. Two things must not be sent too early:

- an incomplete character: a byte-level tokenizer may split one UTF-8 character over several tokens, and decoding
  only the first gives U+FFFD. Like vLLM, we decode a small window (`prefix`..end) and hold the new text back
  while it ends in U+FFFD, which also keeps SentencePiece's leading-space handling right;
- the start of a stop string: text that could still become a stop string is held back until it cannot.
At the end everything held back is sent, so the deltas always add up to the final text.
"""

from __future__ import annotations

import threading

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"
# The scheduler thread decodes while the event loop encodes new requests; a Rust tokenizer may not be used from
# two threads at once ("Already borrowed"), so every use in the server takes this lock (each use is microseconds).
TOKENIZER_LOCK = threading.Lock()


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop or [] if s]
        self.tokens: list[int] = []
        self.text = ""  # all text decoded so far (sent or held back), cut at a stop string once one is found
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found: the answer is over
        self._prefix = 0  # token window start: decoding from here reproduces the text's tail in context
        self._read = 0  # tokens whose text is already in `text`
        self._searched = 0  # `text` up to here holds no whole stop string

    def push(self, new_tokens: list[int]) -> str:
        """Add tokens; return the text that can be sent now (possibly empty)."""
        if self.stopped:
            return ""
        self.tokens.extend(new_tokens)
        window, known = self._decode_window()
        if not window.endswith(REPLACEMENT):  # otherwise wait for the rest of the character
            self.text += window[len(known) :]
            self._prefix, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The answer is over (EOS, length or stop string): return everything still held back."""
        if not self.stopped and self._read < len(self.tokens):
            window, known = self._decode_window()
            self.text += window[len(known) :]
            self._read = len(self.tokens)
            self._cut_at_stop()
        return self._release(final=True)

    def _decode_window(self) -> tuple[str, str]:
        """(text of the window prefix..end, text of prefix..read): their difference is the new text."""
        with TOKENIZER_LOCK:
            window = self.tokenizer.decode(self.tokens[self._prefix :], skip_special_tokens=True)
            known = self.tokenizer.decode(self.tokens[self._prefix : self._read], skip_special_tokens=True)
        return window, known

    def _cut_at_stop(self) -> None:
        """Search only the tail a stop string could end in: the new text and the len(stop) - 1 characters before
        it, so the work per token is bounded by the stop strings' lengths, never by the length of the answer."""
        if not self.stop:
            return
        hits = [i for i in (self.text.find(s, max(0, self._searched - len(s) + 1)) for s in self.stop) if i >= 0]
        self._searched = len(self.text)
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        self._cut_at_stop()
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._stop_prefix_held()
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def _stop_prefix_held(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string (tails start only where
        the stop's first character is, and none is longer than the stop, so no answer-length scan)."""
        best = 0
        for s in self.stop:
            tail = self.text[len(self.text) - min(len(s) - 1, len(self.text)) :]
            i = tail.find(s[0])
            while 0 <= i < len(tail) - best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best
