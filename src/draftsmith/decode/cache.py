"""KV-cache rollback and compaction: after verification, keep only the entries of accepted tokens, in order."""

import torch
from transformers import Cache


def rollback(cache: Cache, keep: int) -> None:
    """Truncate `cache` to its first `keep` positions (a no-op when it is not longer)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def compact(cache: Cache, keep: int, rows: list[int]) -> None:
    """After a tree was verified: keep the first `keep` positions, then the entries at `rows` (cache indices of
    the accepted path, ascending), and drop the rest, so the cache reads as if the path had been a chain."""
    if rows == list(range(keep, keep + len(rows))):  # the path is already in place: a plain crop
        rollback(cache, keep + len(rows))
        return
    for layer in cache.layers:
        index = torch.cat([torch.arange(keep), torch.tensor(rows, dtype=torch.long)]).to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
