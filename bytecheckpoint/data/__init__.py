"""Reshardable data loading: token sources and a stateful token-buffer loader."""

from .loader import TokenBatch, TokenLoader
from .source import TokenSource, synthetic_sources, write_source
from .streams import ID_BITS, sample_id

__all__ = ["TokenLoader", "TokenBatch", "TokenSource", "write_source", "synthetic_sources",
           "sample_id", "ID_BITS"]
