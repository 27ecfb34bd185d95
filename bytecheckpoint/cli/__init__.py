"""The ``bcp`` command line, one module per command; :func:`main` is the entry point."""

from .app import main as main
