"""The library's version: its own module so ``bcp --version`` and the metadata writer read it without
importing torch (pyproject.toml holds the same string; tests/e2e/test_cli_lazy.py checks they agree)."""

__version__ = "0.1.0"
