"""RNG state that a resume can put back twice: once on load, and again once the trainer's
resumed data loader has started (starting a loader draws from the global RNG)."""

from __future__ import annotations

from typing import Any

import bytecheckpoint as bcp


class KeptRNG(bcp.RNGState):
    """Every process's RNG, restored on load and kept for :meth:`restore_again`."""

    entries: dict[str, Any] | None = None

    def restore_shards(self, entries: dict[str, Any]) -> None:
        self.entries = dict(entries)
        super().restore_shards(entries)

    def restore_again(self) -> None:
        if self.entries is not None:
            super().restore_shards(self.entries)
