"""The `draftsmith` command: parse options, call the stage function, print. Nothing here asks questions."""

import functools
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from draftsmith.errors import DraftsmithError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True, soft_wrap=True)


def user_errors(fn):
    """Print a DraftsmithError as one line plus its hint and exit 2; bugs keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DraftsmithError as exc:
            console.print(f"[bold red]error:[/] {exc.message}", highlight=False)
            if exc.hint:
                console.print(f"[yellow]hint:[/] {exc.hint}", highlight=False)
            sys.exit(2)

    return wrapper


TargetOpt = Annotated[str, typer.Option(help="built-in name (smollm2-135m), local HF directory, or hub id")]
DrafterOpt = Annotated[str, typer.Option(help="ngram | ngram:MIN-MAX | model:<id or dir> | none")]
DatasetOpt = Annotated[str, typer.Option(help="builtin | mt_bench | humaneval | gsm8k | a .jsonl/.json/.jsonl.gz file")]
DataDirOpt = Annotated[
    Path | None, typer.Option(envvar="DRAFTSMITH_DATA", help="folder with mt_bench/humaneval/gsm8k files")
]


@app.command("eval")
@user_errors
def eval_cmd(
    target: TargetOpt = "smollm2-135m",
    drafter: DrafterOpt = "ngram",
    dataset: DatasetOpt = "builtin",
    data_dir: DataDirOpt = None,
    limit: Annotated[int | None, typer.Option(help="first N prompts only")] = None,
    max_new_tokens: int = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: float = 1.0,
    num_draft_tokens: Annotated[int, typer.Option(help="most draft tokens verified per target forward")] = 7,
    seed: int = 0,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    out: Annotated[Path, typer.Option(help="where report.json and report.md go")] = Path("runs/eval"),
) -> None:
    """Speculative decoding vs `model.generate` on a prompt set: acceptance length, speedup, identical output."""
    options = dict(locals())
    from draftsmith.config import EvalConfig

    run_eval(EvalConfig.checked(**options))


def run_eval(cfg) -> dict:
    from draftsmith.data.sources import load_eval_prompts
    from draftsmith.drafters import build_drafter
    from draftsmith.evaluate import evaluate, print_report, write_report
    from draftsmith.target import load_target

    dataset, prompts = load_eval_prompts(cfg.dataset, cfg.data_dir, cfg.limit)
    tgt = load_target(cfg.target, dtype=cfg.dtype)
    drafter = build_drafter(cfg.drafter, tgt, dtype=cfg.dtype)
    report = evaluate(tgt, drafter, dataset, prompts, cfg)
    write_report(report, cfg.out)
    print_report(report, Console())
    console.print(f"wrote {cfg.out / 'report.json'} and {cfg.out / 'report.md'}")
    return report


@app.command()
@user_errors
def demo(
    data_dir: DataDirOpt = None,
    limit: Annotated[int, typer.Option(help="MT-bench prompts to evaluate")] = 8,
    out: Path = Path("runs/demo"),
) -> None:
    """The main job on the built-in target: the n-gram drafter vs plain decoding on MT-bench."""
    from draftsmith.config import EvalConfig

    run_eval(EvalConfig.checked(dataset="mt_bench", data_dir=data_dir, limit=limit, out=out))


if __name__ == "__main__":
    app()
