"""Token sources: variable-length samples of token ids, memory-mapped, never unpickled.

A source is a directory with ``tokens.npy`` (all samples' tokens, int32, concatenated) and
``offsets.npy`` (int64, ``n + 1`` entries: sample ``i`` is ``tokens[offsets[i]:offsets[i+1]]``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

TOKENS_FILE = "tokens.npy"
OFFSETS_FILE = "offsets.npy"


class SourceError(ValueError):
    pass


class TokenSource:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.tokens = np.load(os.path.join(path, TOKENS_FILE), mmap_mode="r", allow_pickle=False)
            self.offsets = np.load(os.path.join(path, OFFSETS_FILE), allow_pickle=False)
        except FileNotFoundError as exc:
            raise SourceError(
                f"{path} is not a token source: {exc.filename} is missing (write one with "
                "bytecheckpoint.data.write_source)"
            ) from None
        if (self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0
                or self.offsets[-1] != len(self.tokens) or np.any(np.diff(self.offsets) < 0)):
            raise SourceError(f"{path}: offsets.npy does not index tokens.npy")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, index: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[index] : self.offsets[index + 1]], dtype=np.int32)

    def length(self, index: int) -> int:
        return int(self.offsets[index + 1] - self.offsets[index])


def write_source(path: str, samples: Iterable[Sequence[int] | np.ndarray]) -> str:
    """Write samples (sequences of token ids) as a token source directory."""
    arrays = [np.asarray(s, dtype=np.int32) for s in samples]
    os.makedirs(path, exist_ok=True)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    np.save(os.path.join(path, TOKENS_FILE), tokens, allow_pickle=False)
    np.save(os.path.join(path, OFFSETS_FILE), offsets, allow_pickle=False)
    return path


def synthetic_sources(root: str, sizes: Sequence[int], vocab: int, min_len: int = 4,
                      max_len: int = 160, seed: int = 0) -> list[str]:
    """Sources of random samples with lengths in ``[min_len, max_len]`` (demo and tests)."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, n in enumerate(sizes):
        lengths = rng.integers(min_len, max_len + 1, size=n)
        samples = [rng.integers(0, vocab, size=int(k), dtype=np.int32) for k in lengths]
        paths.append(write_source(os.path.join(root, f"source_{i}"), samples))
    return paths
