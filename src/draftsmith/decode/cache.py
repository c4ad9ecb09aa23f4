"""KV-cache rollback: after verification, drop the cache entries of rejected draft tokens."""

from transformers import Cache


def rollback(cache: Cache, keep: int) -> None:
    """Truncate `cache` to its first `keep` positions (a no-op when it is not longer)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)
