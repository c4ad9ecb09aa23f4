"""Draft trees: their shape, the attention mask and positions that verify them in one forward, and acceptance.

A tree of m draft nodes hangs below the *root*, the newest confirmed token (which the engine feeds first anyway).
Node i holds a token and the index of its parent (-1 = the root); parents come before their children, so the
nodes are in topological order. Verification runs the target once over [root, node 0, ..., node m-1]: each of
those m + 1 queries sees the whole KV cache, its ancestors and itself (the tree mask), at position
(cache length + depth), so every root-to-node path gets the logits a chain of the same tokens would get.

Acceptance, lossless either way:
- greedy: walk down from the root, each step to the (first) child whose token is the target's argmax; the path's
  tokens are accepted and the argmax after its last node is the bonus token.
- sampling (multi-candidate speculative sampling, SpecInfer / EAGLE-2): at a node with target distribution p, try
  its children in order; child j with token x, drawn from q_j (None = a deterministic pick, i.e. a point mass), is
  accepted with probability min(1, p(x) / q_j(x)); on rejection p becomes normalise(max(0, p - q_j)), which for a
  point mass removes x's mass and renormalises. So a sibling repeating a rejected deterministic token is never
  accepted, and independent draws from q may repeat freely. The first accepted child becomes the node; when none
  is, the next token is drawn from what is left of p (the bonus).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from draftsmith.errors import ConfigError


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2's dynamic tree: `topk` children of each of the `topk` best frontier nodes, for `depth` levels; the
    best `total` nodes by cumulative draft log-probability are verified. topk=1 is a chain of `depth` tokens."""

    depth: int
    topk: int
    total: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.total < 1:
            raise ConfigError(
                f"tree shape {self} needs depth, topk and total of at least 1",
                hint="e.g. --tree depth=5,topk=4,total=16",
            )
        if self.total > self.capacity:
            raise ConfigError(
                f"tree shape {self} asks for {self.total} tokens but depth {self.depth} and top-k {self.topk} hold "
                f"at most {self.capacity}",
                hint=f"use total <= {self.capacity}, or a deeper or wider tree",
            )

    @property
    def capacity(self) -> int:
        """Most nodes the expansion can produce: topk at depth 1, then topk * topk candidates per further level."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def __str__(self) -> str:
        return f"depth={self.depth},topk={self.topk},total={self.total}"

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """'depth=5,topk=4,total=16' (any order); total defaults to what the shape holds, capped at 64."""
        fields: dict[str, int] = {}
        for part in text.split(","):
            match = re.fullmatch(r"\s*(depth|topk|total)\s*=\s*(-?\d+)\s*", part)
            if match is None:
                raise ConfigError(
                    f"bad tree shape {text!r} (at {part.strip()!r})",
                    hint="write depth=D,topk=K[,total=N], e.g. depth=5,topk=4,total=16, or 'auto'",
                )
            fields[match[1]] = int(match[2])
        if "depth" not in fields or "topk" not in fields:
            raise ConfigError(f"tree shape {text!r} needs depth and topk", hint="e.g. depth=5,topk=4,total=16")
        for key, value in fields.items():
            if value < 1:
                raise ConfigError(
                    f"tree shape {text!r}: {key} must be a positive integer, got {value}",
                    hint="e.g. depth=5,topk=4,total=16",
                )
        depth, topk = fields["depth"], fields["topk"]
        total = fields.get("total", min(64, topk + (depth - 1) * topk * topk))
        return cls(depth, topk, total)

    def check_vocab(self, draft_vocab_size: int) -> None:
        if self.topk > draft_vocab_size:
            raise ConfigError(
                f"tree top-k {self.topk} is larger than the draft vocabulary ({draft_vocab_size} tokens)",
                hint=f"use topk <= {draft_vocab_size}",
            )


def depths(parents: torch.Tensor) -> torch.Tensor:
    """(m,) depth of each node, 1 for the root's children (parents come before children)."""
    out = torch.zeros(len(parents), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        out[i] = 1 if p < 0 else out[p] + 1
    return out


def ancestry(parents: torch.Tensor) -> torch.Tensor:
    """(m, m) bool: [i, j] is True when node j is node i or one of its ancestors."""
    m = len(parents)
    seen = torch.eye(m, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            seen[i] |= seen[p]
    return seen


def verify_mask(parents: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, m+1, past+m+1) additive mask for the forward over [root, nodes] on a `past`-long cache."""
    m = len(parents)
    seen = torch.ones(m + 1, past + m + 1, dtype=torch.bool)
    seen[:, past:] = False
    seen[:, past] = True  # everyone sees the root
    seen[1:, past + 1 :] = ancestry(parents)
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    return mask[None, None]


def verify_positions(parents: torch.Tensor, past: int) -> torch.Tensor:
    """(m+1,) positions of [root, nodes]: the root at `past`, a node at `past` + its depth."""
    return torch.cat([torch.zeros(1, dtype=torch.long), depths(parents)]) + past


def children(parents: torch.Tensor) -> list[list[int]]:
    """children[0] are the root's children, children[i + 1] node i's, each in node order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents.tolist()):
        out[p + 1].append(i)
    return out


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """`logits` (m+1, V) over [root, nodes]; returns (accepted node indices, root to leaf; next token)."""
    choice = logits.argmax(-1).tolist()
    kids, toks = children(parents), tokens.tolist()
    path: list[int] = []
    row = 0  # logits row of the current node: 0 = root, i + 1 = node i
    while True:
        nxt = next((c for c in kids[row] if toks[c] == choice[row]), None)
        if nxt is None:
            return path, choice[row]
        path.append(nxt)
        row = nxt + 1


def accept_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """`probs` (m+1, V) target distributions over [root, nodes]; `draft_probs` (m, V) the q each node was drawn
    from, or None (all deterministic). Returns (accepted node indices, next token)."""
    kids, toks = children(parents), tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        p = probs[row]
        for c in kids[row]:
            x = toks[c]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft_probs[c].to(p)
            u = float(torch.rand(1, generator=generator))
            if q[x] > 0 and u * q[x] <= p[x]:
                path.append(c)
                row = c + 1
                break
            residual = (p - q).clamp_min(0.0)
            total = residual.sum()
            if total <= 0:  # p is a subset of q's mass and the draw failed: only float noise gets here
                residual, total = p, p.sum()
            p = residual / total
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
