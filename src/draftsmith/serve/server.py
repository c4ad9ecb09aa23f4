"""`draftsmith serve`: load the target and drafter, bind the socket, run the app under uvicorn.

The socket is bound before the (slow) model load, so a busy port fails in a second, and `--port 0` picks a free
port. Once the scheduler runs, one line `draftsmith serve: ready on http://HOST:PORT (model NAME)` goes to stderr;
scripts and tests wait for it (see `serve.process.ServerProcess`).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Literal

from pydantic import Field

from draftsmith.config import StageConfig
from draftsmith.errors import ConfigError

READY = "draftsmith serve: ready on"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
WILDCARD = {"0.0.0.0", "::", ""}


def allowed_hosts(host: str) -> frozenset[str] | None:
    """The Host header names a request may carry: the loopback names on a loopback bind, the bound address on
    another; None (any) on a wildcard bind, which has no one name to check."""
    if host in LOOPBACK:
        return frozenset(LOOPBACK)
    return None if host in WILDCARD else frozenset({host.lower()})


def public_name(spec: str) -> str:
    """A target or drafter as a client may see it: a local path shrinks to its last component (`model:/home/me/d`
    -> `model:d`), a hub id or built-in name stays."""
    kind, sep, rest = spec.rpartition(":") if ":" in spec and not spec.startswith("/") else ("", "", spec)
    local = rest.startswith(("/", "./", "../", "~")) or "\\" in rest or (os.sep in rest and os.path.exists(rest))
    return f"{kind}{sep}{os.path.basename(rest.rstrip('/')) or rest}" if local else spec


class ServeConfig(StageConfig):
    target: str = "smollm2-135m"
    dtype: str = "float32"
    drafter: str = "ngram"
    num_draft_tokens: int = Field(default=7, ge=1, le=64)
    tree: str | None = None  # draft trees: "depth=D,topk=K,total=N", "auto" (a short tune first), or a tune.json
    drafter_precision: Literal["auto", "float32", "int8"] = "auto"  # EAGLE-3 weights while drafting (auto: int8 on CPU)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model_name: str | None = None
    max_active: int = Field(default=4, ge=1, le=256)
    max_queue: int = Field(default=32, ge=0, le=100_000)
    default_max_tokens: int = Field(default=256, ge=1)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    body_timeout: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=256, ge=1)  # open connections; beyond it uvicorn answers 503
    refusal_hold: float = Field(default=1.0, ge=0)  # most seconds a client's 4xx answers wait (serve/throttle.py)
    api_key: str | None = None
    threads: int | None = Field(default=None, ge=1)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            hint="pick another --port (or --port 0 for any free one), or stop the process that holds it",
        ) from None
    return sock


def serve(cfg: ServeConfig) -> None:
    import torch
    import uvicorn

    from draftsmith.formats.load import build_drafter
    from draftsmith.serve.app import ServerState, create_app
    from draftsmith.serve.metrics import ServerMetrics
    from draftsmith.serve.scheduler import Scheduler
    from draftsmith.serve.throttle import ErrorScore
    from draftsmith.target import load_target
    from draftsmith.tune import resolve_tree

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    if cfg.host not in LOOPBACK and not cfg.api_key:
        print(
            f"warning: serving on {cfg.host} without authentication (--api-key); anyone who can reach it can use it",
            file=sys.stderr,
        )

    target = load_target(cfg.target, dtype=cfg.dtype)
    shape = resolve_tree(cfg.tree, target, cfg.drafter, cfg.dtype, cfg.drafter_precision)
    drafter = build_drafter(cfg.drafter, target, dtype=cfg.dtype, tree=shape, precision=cfg.drafter_precision)
    draft_tokens = cfg.num_draft_tokens if shape is None else shape.total
    model_name = cfg.model_name or public_name(cfg.target)
    metrics = ServerMetrics(
        draft_tokens, target=public_name(cfg.target), drafter=public_name(drafter.name), model=model_name
    )
    scheduler = Scheduler(target, drafter, metrics, draft_tokens, cfg.max_active, cfg.max_queue)
    warm_up(scheduler)

    def ready() -> None:
        print(f"{READY} {url} (model {model_name}, drafter {drafter.name})", file=sys.stderr, flush=True)

    state = ServerState(
        target, scheduler, metrics, model_name, cfg.default_max_tokens, cfg.max_body_bytes, cfg.body_timeout,
        allowed_hosts=allowed_hosts(cfg.host), api_key=cfg.api_key, on_ready=ready,
        refusals=ErrorScore(most=cfg.refusal_hold),
    )  # fmt: skip
    config = uvicorn.Config(
        create_app(state), log_level="warning", access_log=False, timeout_graceful_shutdown=5,
        limit_concurrency=cfg.max_connections, timeout_keep_alive=5,
    )  # fmt: skip
    uvicorn.Server(config).run(sockets=[sock])


def warm_up(scheduler) -> None:
    """One short generation outside the metrics, so the first client does not pay for lazy initialisation."""
    from draftsmith.decode.engine import SpeculativeDecoder
    from draftsmith.serve.scheduler import fork_drafter

    target = scheduler.target
    ids = target.tokenizer("Hello")["input_ids"] or [0]
    SpeculativeDecoder(target, fork_drafter(scheduler.template), scheduler.num_draft_tokens).generate(ids, 4)
