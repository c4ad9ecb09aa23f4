"""KV-cache rollback and compaction: after verification, keep only the entries of accepted tokens, in order."""

import torch
from transformers import Cache


def rollback(cache: Cache, keep: int) -> None:
    """Truncate `cache` to its first `keep` positions (a no-op when it is not longer)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()  # the forwards that filled the cache made inference tensors: only updated in this mode
def compact(cache: Cache, keep: int, rows: list[int]) -> None:
    """After a tree was verified: keep the first `keep` positions, then the entries at `rows` (cache indices of
    the accepted path, ascending), and drop the rest, so the cache reads as if the path had been a chain. Only the
    path's rows move (copying the whole cache cost ~9 % of a SmolLM2 step on a CPU at 300 positions)."""
    if rows != list(range(keep, keep + len(rows))):  # else the path is already in place: a plain crop
        for layer in cache.layers:
            index = torch.tensor(rows, dtype=torch.long, device=layer.keys.device)
            layer.keys[..., keep : keep + len(rows), :] = layer.keys.index_select(-2, index)
            layer.values[..., keep : keep + len(rows), :] = layer.values.index_select(-2, index)
    rollback(cache, keep + len(rows))
