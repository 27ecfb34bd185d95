"""Functions of the C library that Python's ``os`` module lacks, looked up through ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any


def function(name: str, argtypes: list[Any], restype: Any) -> Any | None:
    """``name`` from the C library with its signature set (``errno`` kept for
    ``ctypes.get_errno``), or None off Linux or where the library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
