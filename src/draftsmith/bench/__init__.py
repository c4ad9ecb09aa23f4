"""`draftsmith bench`: a load generator for any OpenAI-compatible endpoint, with a report and plots.

client.py (streamed requests, timing, a level's closed loop), stats.py (rates, percentiles), server_stats.py (the
server's own counters from /metrics), report.py (JSON, Markdown, console), plots.py (PNGs), compare.py (B / A per
concurrency), run.py (the whole run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bench(cfg, log=print) -> dict[str, Any]:
    """Run every level of `cfg` (a `BenchConfig`), write result.json, result.md and the plots to `cfg.out`."""
    from draftsmith.bench.plots import write_plots
    from draftsmith.bench.report import print_table, write_result
    from draftsmith.bench.run import run_bench
    from draftsmith.util import claim_dir

    claim_dir(Path(cfg.out), "bench")  # before the load: a folder of someone's files is refused, not written into
    result = run_bench(cfg, log)
    write_result(result, Path(cfg.out))
    write_plots(result, Path(cfg.out))
    print_table(result)
    return result
