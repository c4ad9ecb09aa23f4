"""Server counters, gauges and histograms, rendered in the Prometheus text exposition format (version 0.0.4).

Written here rather than with prometheus_client: the server needs a dozen series, and a thread-safe registry of
them is fifty lines. The scheduler's worker thread and the HTTP event loop both update them, so one lock guards
every series. Counter and histogram names follow Prometheus conventions (`_total`, `_bucket`/`_sum`/`_count`).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence

LabelValues = tuple[str, ...]


class _Series:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.labels = name, help_text, tuple(labels)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {sorted(labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def _label_text(self, values: LabelValues, extra: str = "") -> str:
        parts = [f'{k}="{_escape(v)}"' for k, v in zip(self.labels, values, strict=True)]
        if extra:
            parts.append(extra)
        return "{" + ",".join(parts) + "}" if parts else ""

    def samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Series):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (), initial: Sequence[LabelValues] = ()):
        super().__init__(name, help_text, labels)
        # Series that should read 0 before their first event (so a rate() over them starts at 0, not missing).
        self.values: dict[LabelValues, float] = dict.fromkeys(initial if labels else [()], 0.0)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        return [f"{self.name}{self._label_text(k)} {_num(v)}" for k, v in sorted(self.values.items())]


class Gauge(_Series):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float] | None = None) -> None:
        super().__init__(name, help_text)
        self.value = 0.0
        self.read = read  # a gauge read at scrape time (e.g. resident memory) instead of being set

    def set(self, value: float) -> None:
        self.value = float(value)

    def samples(self) -> list[str]:
        return [f"{self.name} {_num(self.read() if self.read else self.value)}"]


class Info(_Series):
    """A constant series with value 1 whose labels describe the server (target, drafter, model name)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, **labels: str) -> None:
        super().__init__(name, help_text, tuple(labels))
        self.values = tuple(labels.values())

    def samples(self) -> list[str]:
        return [f"{self.name}{self._label_text(self.values)} 1"]


class Histogram(_Series):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        self.bounds = sorted(buckets)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative; cumulated when rendered
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.count += 1
        self.sum += value

    def samples(self) -> list[str]:
        lines, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_num(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    """Every series the server exposes on /metrics. Call `update` (a context manager) around any change."""

    def __init__(self, num_draft_tokens: int, target: str, drafter: str, model: str) -> None:
        self.lock = threading.Lock()
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.info = Info(
            "draftsmith_server_info", "What this server runs.", target=target, drafter=drafter, model=model
        )
        self.http_requests = Counter(
            "draftsmith_http_requests_total", "HTTP responses sent, by path and status code.", ("path", "code")
        )
        self.finished = Counter(
            "draftsmith_requests_finished_total",
            "Generation requests that left the scheduler, by reason: stop (EOS or a stop string), length "
            "(max_tokens), cancelled (the client went away), error.",
            ("reason",),
            initial=[("stop",), ("length",), ("cancelled",), ("error",)],
        )
        self.rejected = Counter(
            "draftsmith_requests_rejected_total",
            "Generation requests refused with 429 because the queue was full.",
        )
        self.prompt_tokens = Counter("draftsmith_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter(
            "draftsmith_generation_tokens_total",
            "Tokens generated (EOS included), the same count each response's usage.completion_tokens reports.",
        )
        self.target_forwards = Counter(
            "draftsmith_target_forwards_total", "Target forward passes, prefills included (one per engine round)."
        )
        self.acceptance = Histogram(
            "draftsmith_acceptance_length",
            "Tokens produced per target forward (accepted draft tokens + 1; a prefill produces 1). "
            "sum/count is the acceptance length tau.",
            buckets=range(1, num_draft_tokens + 2),
        )
        self.ttft = Histogram(
            "draftsmith_time_to_first_token_seconds", "From admission to the queue to the first token.", latency
        )
        self.e2e = Histogram("draftsmith_request_latency_seconds", "From admission to the last token.", latency)
        self.queue_wait = Histogram(
            "draftsmith_queue_wait_seconds", "Time a request waited in the queue before its prefill.", latency
        )
        self.queue_depth = Gauge("draftsmith_queue_depth", "Requests waiting for a decoding slot.")
        self.active = Gauge("draftsmith_active_requests", "Requests being decoded (interleaved round by round).")
        self.queue_capacity = Gauge("draftsmith_queue_capacity", "Most requests that may wait; beyond it: 429.")
        self.slots = Gauge("draftsmith_decode_slots", "Most requests decoded at once.")
        self.rss = Gauge("process_resident_memory_bytes", "Resident memory of the server process.", resident_bytes)

    def update(self) -> threading.Lock:
        return self.lock

    def render(self) -> str:
        series: list[_Series] = [v for v in vars(self).values() if isinstance(v, _Series)]
        out = []
        with self.lock:
            for s in series:
                out.append(f"# HELP {s.name} {s.help}")
                out.append(f"# TYPE {s.name} {s.kind}")
                out.extend(s.samples())
        return "\n".join(out) + "\n"


def resident_bytes() -> float:
    """Current resident set size (not the peak), from /proc on Linux; the peak from getrusage elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))
