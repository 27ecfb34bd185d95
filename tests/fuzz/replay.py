"""Rerun one case of the long run: ``python -m tests.fuzz.replay TARGET SEED INDEX``.

The case is drawn exactly as the long run drew it and run behind the guard, so a crash or
hang shows as such; the outcome and its detail are printed."""

from __future__ import annotations

import sys

from tests.fuzz import cases
from tests.fuzz.guard import Guard
from tests.fuzz.session import context


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in cases.TARGETS:
        print(__doc__, file=sys.stderr)
        return 2
    target, seed, index = argv[0], int(argv[1]), int(argv[2])
    case = cases.draw(target, cases.case_rng(seed, target, index), context())
    print(cases.describe(case))
    guard = Guard()
    try:
        result = guard.case(case)
    finally:
        guard.close()
    print(f"{result.kind}\n{result.detail}")
    return 1 if result.bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
