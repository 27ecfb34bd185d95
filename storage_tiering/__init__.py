"""Storage tiering: a cooling service that moves old checkpoints from a hot tier to a cold
tier while their paths stay the same (DESIGN.md §7, docs/tiering.md).

    python -m storage_tiering --once --hot /ssd/ckpt --cold /hdd/ckpt --cool-after 7d

``run_once`` is the same pass from Python. The policy lives in :mod:`.policies` and
:mod:`.plan`, the move in :mod:`.mover`, the crash journal in :mod:`.journal`.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, TieringConfig, load_config

__all__ = ["ConfigError", "Report", "TieringConfig", "load_config", "run_once"]


def __getattr__(name: str) -> Any:
    # The service reads checkpoint metadata (which imports torch): loaded on first use, so
    # `bcp tier --help` answers at once.
    if name in ("Report", "run_once"):
        from . import service

        return getattr(service, name)
    raise AttributeError(f"module 'storage_tiering' has no attribute {name!r}")
