"""One function per stage, shared by the CLI subcommands and `draftsmith run`, so both do exactly the same thing.

Each takes its settings (a pydantic config, the same one a YAML profile fills in), the directories it reads and
writes, and an already loaded target where it needs one: a pipeline loads the target once for all stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from draftsmith.config import EvalConfig, StageConfig
from draftsmith.data.synth import SYNTH_KINDS, check_kinds
from draftsmith.errors import ConfigError
from draftsmith.target import Target
from draftsmith.train.trainer import TrainConfig, TrainResult
from draftsmith.tune import DEFAULT_GRID
from draftsmith.util import claim_dir


class DataConfig(StageConfig):
    sources: list[str] = []  # files or hub dataset ids; `$VARS` are expanded
    optional_sources: list[str] = []  # used when the file exists (e.g. the shared benchmark folder), else skipped
    regenerate: bool = False
    synth: int = Field(default=0, ge=0)
    synth_kinds: list[str] = list(SYNTH_KINDS)  # each synthesised prompt steered to one kind, in turns; [] = unsteered
    self_chat: int = Field(default=0, ge=0)  # chats the target writes both sides of (data/selfchat.py), synth_kinds
    self_chat_length: int = Field(default=512, ge=16)  # tokens per self-chat, template included
    self_chat_minutes: float | None = Field(default=None, gt=0)  # ... or as many as fit in this time (whole batches)
    self_chat_user_temperature: float = Field(default=1.0, gt=0)  # the sampled user turns (replies stay greedy)
    self_chat_loop_ngram: int = Field(default=0, ge=0)  # N > 0: a reply ends before it repeats one of its N-grams
    # keep the hidden states (default aux layers) of self-chats and regenerated conversations (transformers) as they
    # are written: extract copies them, no second pass
    record_features: bool = False
    limit: int | None = Field(default=None, ge=1)
    skip: int = Field(default=0, ge=0)  # records skipped at the start of each source: held out for evaluation
    hf_split: str = "train"
    temperature: float = Field(default=0.0, ge=0.0)
    max_new_tokens: int = Field(default=256, ge=1)
    batch_size: int = Field(default=16, ge=1)
    seed: int = 0
    backend: Literal["transformers", "vllm"] = "transformers"  # the engine that synthesises and regenerates
    # vllm: extra `vllm.LLM(...)` arguments, e.g. {tensor_parallel_size: 8}; transformers: {dtype: bfloat16} computes
    # in a bf16 copy of the target (AMX CPUs: 2-4x the tokens per hour; serving stays in the target's dtype)
    backend_options: dict[str, Any] = {}

    @field_validator("synth_kinds")
    @classmethod
    def _known_kinds(cls, kinds: list[str]) -> list[str]:
        try:
            return list(check_kinds(kinds))
        except ConfigError as exc:
            raise ValueError(exc.message) from None


class ExtractConfig(StageConfig):
    layers: tuple[int, ...] | None = None  # default: the states entering layers (2, N//2, N-3)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_length: int = Field(default=2048, ge=2)
    shard_size: int = Field(default=64, ge=1)
    backend: Literal["transformers", "vllm"] = "transformers"  # the engine that computes the features
    backend_options: dict[str, Any] = {}  # vllm: extra `vllm.LLM(...)` arguments (+ hidden_states_dir); as for data


class VocabConfig(StageConfig):
    size: int = Field(default=8192, ge=1)


def resolve_sources(cfg: DataConfig) -> list[str]:
    import os

    from rich.console import Console

    sources = [os.path.expandvars(s) for s in cfg.sources]
    for source in (os.path.expandvars(s) for s in cfg.optional_sources):
        if Path(source).exists():
            sources.append(source)
        else:
            Console(stderr=True).print(f"[yellow]skipping optional source {source}: not found[/]", highlight=False)
    return sources


def data(cfg: DataConfig, out: Path, target: Target | None) -> Path:
    from draftsmith.backends import get_backend
    from draftsmith.data.stage import build_dataset

    claim_dir(out, "data")
    backend = get_backend(cfg.backend, target, cfg.backend_options) if target is not None else None
    try:
        return build_dataset(
            resolve_sources(cfg), out, target=target, regenerate=cfg.regenerate, synth=cfg.synth,
            self_chat=cfg.self_chat, self_chat_length=cfg.self_chat_length, self_chat_minutes=cfg.self_chat_minutes,
            self_chat_user_temperature=cfg.self_chat_user_temperature,
            self_chat_loop_ngram=cfg.self_chat_loop_ngram, record_features=cfg.record_features,
            synth_kinds=cfg.synth_kinds,
            limit=cfg.limit, skip=cfg.skip, hf_split=cfg.hf_split, seed=cfg.seed,
            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, backend=backend,
        )  # fmt: skip
    finally:
        if backend is not None:
            backend.close()


def extract(cfg: ExtractConfig, data_dir: Path, out: Path, target: Target) -> Path:
    from draftsmith.backends import get_backend
    from draftsmith.data.regenerate import recorded_dir
    from draftsmith.data.stage import CHATS, REGENERATED, load_stage_conversations
    from draftsmith.data.tokenize import tokenize_dataset
    from draftsmith.store import RecordedFeatures
    from draftsmith.store import extract as run_extract

    claim_dir(out, "extract", mark=False)  # the store writes its own manifest before any shard
    conversations = load_stage_conversations(data_dir)
    backend = get_backend(cfg.backend, target, cfg.backend_options)
    try:
        # the states of self-chats and regenerated conversations, when `data.record_features` kept them
        folders = [f for f in (recorded_dir(Path(data_dir) / name) for name in (CHATS, REGENERATED)) if f.is_dir()]
        recorded = RecordedFeatures(*folders) if folders else None
        if recorded is None:
            samples = list(tokenize_dataset(target.tokenizer, conversations, cfg.max_length))
        else:  # a recorded conversation is stored as the target read it (its tokens); the rest are tokenised as usual
            rest = [c for c in conversations if c.id not in recorded]
            tokenised = {s[0]: s for s in tokenize_dataset(target.tokenizer, rest, cfg.max_length)} if rest else {}
            samples = [
                (c.id, *recorded.sample(c.id)) if c.id in recorded else tokenised[c.id]
                for c in conversations
                if c.id in recorded or c.id in tokenised
            ]
        return run_extract(
            target, samples, out, layer_ids=cfg.layers, dtype=cfg.dtype, shard_size=cfg.shard_size,
            max_length=cfg.max_length, backend=backend, recorded=recorded,
        )  # fmt: skip
    finally:
        backend.close()


def vocab(cfg: VocabConfig, source: Path, out: Path, target: Target | None = None):
    """From an extract store, or (for online training) from a data stage directory tokenised by `target`."""
    from draftsmith.vocab import vocab_from_store

    claim_dir(out, "vocab")
    return vocab_from_store(_features(source, target) if is_data_dir(source) else source, cfg.size, out)


def train(
    cfg: TrainConfig,
    source: Path,
    vocab_dir: Path,
    out: Path,
    target: Target,
    fresh: bool = False,
    online: bool = False,
    layers: tuple[int, ...] | None = None,
) -> TrainResult:
    """Train `cfg.algo` (EAGLE-3 or DFlash) on an extract store, or with `online` on a data stage directory
    (features computed as samples are drawn, from the states entering `layers`). One store serves both: DFlash
    reads every layer the store holds; it reads `vocab_dir` only with `draft_vocab` (its engine's draft vocabulary)."""
    from draftsmith.drafters.dflash import DFlashConfig
    from draftsmith.drafters.eagle3 import VARIANTS, Eagle3Config
    from draftsmith.train.trainer import train as run_train
    from draftsmith.vocab import DraftVocab

    if online != is_data_dir(source):
        raise ConfigError(
            f"{source} is {'a data' if is_data_dir(source) else 'not a data'} stage directory",
            hint="train on an extract store, or pass a `draftsmith data` directory with --online",
        )
    import os

    if os.environ.get("RANK", "0") == "0":  # under torchrun, one process checks and marks the directory
        claim_dir(out, "train")
    dataset = _features(source, target, layers, cfg.max_length)
    dataset.check_compatible(target)
    head = target.model.get_output_embeddings().weight.detach()
    embed = target.model.get_input_embeddings().weight.detach()
    fingerprint = dataset.manifest["target_fingerprint"]
    if cfg.algo == "dflash":
        d2t = DraftVocab.load(vocab_dir).d2t if cfg.draft_vocab else None
        dflash_config = DFlashConfig.from_target(
            target, cfg.draft_layers, dataset.layer_ids, cfg.block_size, cfg.mask_token_id, fingerprint,
            draft_vocab_size=None if d2t is None else len(d2t),
        )  # fmt: skip
        return run_train(cfg, dataset, head, embed, d2t, None, dflash_config, out, resume=not fresh)
    draft_vocab = DraftVocab.load(vocab_dir)
    model_config = Eagle3Config.from_target(
        target,
        len(draft_vocab.d2t),
        dataset.layer_ids,
        fingerprint=fingerprint,
        intermediate_size=cfg.intermediate_size,
        **{k: getattr(cfg, k) for k in VARIANTS},  # the layer variant the train settings ask for
    )
    norm = getattr(target.model.base_model, "norm", None)  # the final norm, for `init: logit_lens`
    return run_train(
        cfg, dataset, head, embed, draft_vocab.d2t, draft_vocab.t2d, model_config, out, resume=not fresh,
        final_norm=None if norm is None else norm.weight.detach(),
    )  # fmt: skip


def is_data_dir(path: Path) -> bool:
    import json

    manifest = Path(path) / "manifest.json"
    return manifest.is_file() and json.loads(manifest.read_text()).get("stage") == "data"


def _features(source: Path, target: Target | None, layers=None, max_length: int = 2048):
    """The training features of `source`: a data stage directory computes them online, else it is a store."""
    from draftsmith.online import OnlineFeatures
    from draftsmith.store import HiddenStateStore

    if not is_data_dir(source):
        return HiddenStateStore(source)
    if target is None:
        raise ConfigError(f"{source} is a data directory: tokenising it needs the target", hint="pass --target")
    return OnlineFeatures(target, source, layers, max_length)


def check_eval(cfg: EvalConfig) -> None:
    """The settings that cannot work together, refused before the target loads."""
    if cfg.fixed_chain == "replayed" and cfg.temperature > 0:
        raise ConfigError(
            f"--fixed-chain replayed needs --temperature 0 (found {cfg.temperature}): only greedy output is the same "
            "whatever the drafts",
            hint="use --fixed-chain timed when sampling",
        )


def evaluate(cfg: EvalConfig, target: Target) -> list[dict]:
    """Evaluate `cfg.drafter` and every drafter in `cfg.compare` against one shared, interleaved baseline; write
    one report per drafter (the first in `cfg.out`, the others in `cfg.out/<name>`)."""
    from draftsmith.data.sources import load_eval_prompts
    from draftsmith.drafters import drafter_costs, drafter_precision, fixed_twin
    from draftsmith.drafters.merged import MergedDrafter
    from draftsmith.evaluate import evaluate_drafters, merge_fixed, write_report
    from draftsmith.formats.load import build_drafter, checkpoint_dir, learned_part, trained_depth
    from draftsmith.tune import predicted_speeds, resolve_tree

    claim_dir(cfg.out, "eval")
    check_eval(cfg)
    dataset, prompts = load_eval_prompts(cfg.dataset, cfg.data_dir, cfg.limit)
    if cfg.engine == "llama.cpp":
        return [_evaluate_llamacpp(cfg, target, dataset, prompts)]
    specs = [cfg.drafter, *cfg.compare]
    for spec in map(learned_part, specs):
        depth = trained_depth(spec) if Path(spec).is_dir() else None
        if depth is not None and cfg.num_draft_tokens > depth:
            warn(
                f"--num-draft-tokens {cfg.num_draft_tokens} is more than the {depth} draft steps {spec} was trained "
                f"for: steps past {depth} continue from states it never learned (use --num-draft-tokens {depth}, or "
                "train with a deeper --ttt-steps)"
            )
    precision = cfg.drafter_precision
    shape = resolve_tree(cfg.tree, target, cfg.drafter, cfg.dtype, precision)
    drafters = [build_drafter(s, target, cfg.dtype, cfg.draft_length, precision=precision) for s in specs]
    twin = fixed_twin(drafters[0])  # a learned drafter's quality: the same drafter with a fixed chain
    if shape is not None:
        # The tree (cut by the adaptive budget, or whole with --draft-length fixed), its drafter's fixed chain of
        # --num-draft-tokens (timed, or replayed at T=0) and, if adaptive or merged, its adaptive or merged chain.
        tree_drafter = build_drafter(cfg.drafter, target, cfg.dtype, cfg.draft_length, shape, precision)
        replay = twin if twin is not None and cfg.fixed_chain == "replayed" else None
        chains = [c for c in (twin, drafters[0]) if c is not None and c is not replay]
        first = [tree_drafter, *chains]
        k = cfg.num_draft_tokens
        tree_report, *rest = evaluate_drafters(
            target,
            [*first, *drafters[1:]],
            dataset,
            prompts,
            cfg,
            len(first),
            [shape.total] + [k] * (len(first) + len(drafters) - 2),
            replayed=replay,
        )
        cut = "the part that pays" if cfg.draft_length == "adaptive" else "all of it"  # tune predicts all of it
        fixed = rest.pop() if replay is not None else rest.pop(0)
        tree_report = merge_fixed(tree_report | {"tree": str(shape), "tree_verified": cut}, fixed)
        if replay is not None:
            tree_report["fixed_chain"] = "replayed"
        merged = isinstance(drafters[0], MergedDrafter)
        if twin is not None:
            tree_report = merge_fixed(tree_report, rest.pop(0), "_merged" if merged else "_adaptive")
        if cfg.tree.endswith(".json"):  # what tune predicted for both, to hold against what was measured
            chain = "_merged" if merged else "_fixed"  # tune's chain of a merged drafter is the merged chain
            tree_report |= predicted_speeds(Path(cfg.tree), shape, cfg.num_draft_tokens, chain)
        reports = [tree_report, *rest]
    elif twin is None:
        reports = evaluate_drafters(target, drafters, dataset, prompts, cfg)
    elif cfg.fixed_chain == "replayed":
        adaptive, *others, fixed = evaluate_drafters(target, drafters, dataset, prompts, cfg, replayed=twin)
        reports = [merge_fixed(adaptive, fixed) | {"fixed_chain": "replayed"}, *others]
    else:
        adaptive, fixed, *others = evaluate_drafters(
            target, [drafters[0], twin, *drafters[1:]], dataset, prompts, cfg, 2
        )
        reports = [merge_fixed(adaptive, fixed), *others]
    for i, (spec, report) in enumerate(zip(specs, reports, strict=True)):
        learned = learned_part(spec)
        report["drafter_checkpoint"] = str(checkpoint_dir(learned)) if Path(learned).is_dir() else None
        report["drafter_precision"] = drafter_precision(drafters[i])
        report["draft_costs"] = drafter_costs(drafters[i])
        write_report(report, cfg.out if i == 0 else cfg.out / _safe_name(spec))
    return reports


class TuneConfig(StageConfig):
    target: str = "smollm2-135m"
    dtype: str = "float32"
    drafter: str = "ngram"
    dataset: str = "builtin"
    data_dir: Path | None = None
    skip: int = Field(default=0, ge=0)  # prompts skipped first (e.g. those an eval will measure on)
    limit: int = Field(default=10, ge=1)
    max_new_tokens: int = Field(default=128, ge=2)
    depths: list[int] = list(DEFAULT_GRID[0])
    topks: list[int] = list(DEFAULT_GRID[1])
    totals: list[int] = list(DEFAULT_GRID[2])
    chains: list[int] = list(DEFAULT_GRID[3])
    drafter_precision: Literal["auto", "float32", "int8"] = "auto"  # EAGLE-3 weights while drafting, as served
    out: Path = Path("runs/tune")


def tune(cfg: TuneConfig, target: Target) -> dict:
    """`draftsmith tune`: the tree shape or chain length with the best predicted tokens/s on this machine, from
    the target's verify costs timed here and acceptance replayed on a prompt set; writes `out/tune.json`."""
    from draftsmith.data.sources import load_eval_prompts
    from draftsmith.data.tokenize import encode_chat
    from draftsmith.drafters import with_tree
    from draftsmith.formats.load import build_drafter
    from draftsmith.tune import candidate_shapes, engine_flags, fitting, write_tune
    from draftsmith.tune import tune as run_tune

    dataset, prompts = load_eval_prompts(cfg.dataset, cfg.data_dir, cfg.skip + cfg.limit)
    prompts = prompts[cfg.skip :]
    if not prompts:
        raise ConfigError(f"--skip {cfg.skip} leaves no prompt of {dataset}", hint="lower --skip")
    encoded = [encode_chat(target.tokenizer, c.messages) for c in prompts]
    base = build_drafter(cfg.drafter, target, dtype=cfg.dtype, draft_length="fixed", precision=cfg.drafter_precision)
    shapes = fitting(base, candidate_shapes(cfg.depths, cfg.topks, cfg.totals, cfg.chains))
    if not shapes:
        raise ConfigError("no tree shape or chain to try", hint="give --depths/--topks/--totals or --chains")
    for shape in shapes:
        with_tree(base, shape)  # every bad shape fails here, before any timing
    report = run_tune(target, lambda shape: with_tree(base, shape), encoded, shapes, cfg.max_new_tokens)
    report |= {"drafter": cfg.drafter, "dataset": dataset, "skip": cfg.skip}
    if Path(cfg.drafter).is_dir():
        from draftsmith.formats.common import verifier_name

        report["flags"] = engine_flags(
            report["best"], "<the drafter exported for that engine>", verifier_name(cfg.target)
        )
    write_tune(report, cfg.out)
    return report


def _evaluate_llamacpp(cfg: EvalConfig, target: Target, dataset: str, prompts: list) -> dict:
    """The drafter (a run, checkpoint, GGUF export or .gguf) inside llama-server, against the plain llama-server."""
    from draftsmith.engines.llamacpp import installed
    from draftsmith.engines.llamacpp_eval import evaluate_llamacpp
    from draftsmith.evaluate import write_report
    from draftsmith.formats.gguf import drafter_gguf, served_target

    if cfg.compare or cfg.temperature != 0:
        raise ConfigError(
            "--engine llama.cpp measures one drafter at T=0 (against the plain llama-server)",
            hint="drop --compare and --temperature",
        )
    lc = installed()
    drafter = drafter_gguf(cfg.drafter, cfg.out / "gguf", target.name)
    report = evaluate_llamacpp(lc, target, served_target(target.name, cfg.gguf_target), drafter, dataset, prompts,
                               cfg, threads=cfg.threads, logs=cfg.out / "logs")  # fmt: skip
    report["drafter_checkpoint"] = cfg.drafter
    write_report(report, cfg.out)
    return report


def warn(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[yellow]warning: {message}[/]", highlight=False, soft_wrap=True)


def _safe_name(spec: str) -> str:
    """A folder name inside the report directory for a drafter string: never `..`, `.`, hidden, or a path."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)[:100]
    return (
        name
        if name and not name.startswith(".") and name not in ("manifest.json", "report.json", "report.md")
        else f"_{name}"
    )


# --------------------------------------------------------------------------------------------- shipping stages


class ExportConfig(StageConfig):
    format: Literal["speculators", "sglang", "eagle", "zlab"] = "speculators"  # speculators/eagle: vLLM; sglang:
    # SGLang; zlab: DFlash drafters (SGLang, vLLM)
    verifier: str | None = None  # the target as the engine loads it (default: hub id of a built-in, else its path)
    speculative_tokens: int | None = Field(default=None, ge=1)  # default: the TTT depth it was trained with
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DoctorConfig(StageConfig):
    samples: int = Field(default=4, ge=1)  # stored samples whose hidden states are recomputed
    prompts: int = Field(default=4, ge=1)  # prompts of the acceptance smoke test
    max_new_tokens: int = Field(default=32, ge=1)
    strict: bool = True  # a FAIL fails the stage, so a broken drafter is never benchmarked or shipped


class BenchStageConfig(StageConfig):
    prompts: str | None = None  # a dataset name or file; default: the one the eval stage used
    concurrency: list[int] = Field(default=[1, 4], min_length=1)
    num_prompts: int = Field(default=16, ge=1)  # requests per level
    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    endpoint: Literal["chat", "completions"] = "chat"
    num_draft_tokens: int = Field(default=7, ge=1, le=64)
    max_active: int = Field(default=4, ge=1)  # requests the server decodes at once
    baseline: bool = True  # also bench the target without a drafter, and report drafter / baseline
    seed: int = 0


def export(cfg: ExportConfig, checkpoint: Path, out: Path, store: Path | None, report: Path | None) -> Path:
    """`draftsmith export`: the trained drafter as a directory vLLM or SGLang loads, with its model card."""
    from draftsmith.formats.export import export as run_export

    return run_export(
        checkpoint, out, cfg.format, verifier=cfg.verifier, store=store, report=report,
        speculative_tokens=cfg.speculative_tokens, dtype=cfg.dtype,
    )  # fmt: skip


def doctor(cfg: DoctorConfig, drafter: Path, out: Path, target: Target, store: Path | None) -> list:
    """`draftsmith doctor` on `drafter` against `target`; writes `out/report.json` and `out/report.md`."""
    import json
    from dataclasses import asdict

    from rich.console import Console

    from draftsmith.errors import DraftsmithError
    from draftsmith.formats.doctor import diagnose, print_checks
    from draftsmith.util import write_atomic

    claim_dir(out, "doctor")
    checks = diagnose(drafter, target, store, samples=cfg.samples, prompts=cfg.prompts,
                      max_new_tokens=cfg.max_new_tokens)  # fmt: skip
    report = {"drafter": str(drafter), "target": target.name, "store": str(store) if store else None,
              "checks": [asdict(c) for c in checks]}  # fmt: skip
    write_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    lines = [f"# draftsmith doctor {drafter}", "", "| check | status | detail |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {c.status} | {c.detail.replace('|', '/')} |" for c in checks]
    write_atomic(out / "report.md", "\n".join(lines) + "\n")
    print_checks(checks, f"draftsmith doctor {drafter} (target {target.name})", Console(stderr=True))
    failed = [c for c in checks if c.status == "FAIL"]
    if failed and cfg.strict:
        raise DraftsmithError(
            f"{len(failed)} doctor check(s) failed, first {failed[0].name}: {failed[0].detail}",
            hint=f"see {out / 'report.md'}; set doctor.strict=false to go on regardless",
        )
    return checks


def bench(
    cfg: BenchStageConfig,
    target: str,
    dtype: str,
    drafter: Path,
    out: Path,
    prompts: str,
    data_dir: Path | None,
    threads: int | None,
) -> dict:
    """Start our server (`draftsmith serve`) with `drafter`, load it with `draftsmith bench`, and with `baseline`
    do the same without a drafter; the servers run one after the other, so they never compete for the machine.
    Writes `out/result.json` (drafter), `out/baseline/result.json` and `out/compare.json` (drafter / baseline)."""
    import json

    from rich.console import Console

    from draftsmith.bench import bench as run_bench
    from draftsmith.bench.compare import compare
    from draftsmith.bench.run import BenchConfig
    from draftsmith.serve.process import ServerProcess
    from draftsmith.util import write_atomic

    log = Console(stderr=True, soft_wrap=True).print
    common = ["--target", target, "--dtype", dtype, "--num-draft-tokens", str(cfg.num_draft_tokens),
              "--max-active", str(cfg.max_active), *(["--threads", str(threads)] if threads else [])]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    runs = [("drafter", str(drafter), out)] + ([("baseline", "none", out / "baseline")] if cfg.baseline else [])
    results = {}
    for name, spec, where in runs:
        claim_dir(where, "bench")  # out, and out/baseline: marked before the server log goes in
        log(f"bench: starting `draftsmith serve --drafter {spec}` ({name})")
        with ServerProcess([*common, "--drafter", spec], log=where / "server.log", env=env) as server:
            bench_cfg = BenchConfig(
                url=server.url, concurrency=cfg.concurrency, prompts=prompts, data_dir=data_dir,
                num_prompts=cfg.num_prompts, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                endpoint=cfg.endpoint, seed=cfg.seed, out=where,
            )  # fmt: skip
            results[name] = run_bench(bench_cfg, log=log)
    if cfg.baseline:
        rows = compare(results["baseline"], results["drafter"])
        write_atomic(out / "compare.json", json.dumps({"a": "baseline", "b": "drafter", "rows": rows}, indent=2))
    return results
