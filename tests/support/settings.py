"""The environment variables the test suite and the developer scripts read (see
bytecheckpoint.settings). None of them is read by the installed packages."""

from __future__ import annotations

from bytecheckpoint.settings import Setting, registry

REGISTRY = registry("tests", "Development: the test suite and scripts", (
    Setting("BCP_FUZZ_PROFILE", "tests/fuzz/strategies.py", "default",
            "long: the fuzz tests run the long hypothesis profile (5000 examples each), for a local soak"),
    Setting("BCP_VENV", "scripts/env.sh", ".venv",
            "the virtual environment scripts/env.sh creates or reuses"),
    Setting("BCP_EXTRAS", "scripts/env.sh", "dev",
            "the extras of pyproject.toml scripts/env.sh installs (scripts/demo.sh sets demo)"),
))
