"""Functions of the C library that Python's ``os`` module lacks, looked up through ctypes."""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any


@functools.cache
def _c_library() -> ctypes.CDLL | None:
    """The C library this process already runs on (``dlopen(NULL)``). ``ctypes.util.find_library``
    ran ``ldconfig -p`` in a subprocess for every lookup: 2-3 ms each in a process's first
    save or load, and a fork from a training process that may not be allowed to spawn one."""
    for name in (None, "libc.so.6"):
        try:
            return ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
    return None


def function(name: str, argtypes: list[Any], restype: Any) -> Any | None:
    """``name`` from the C library with its signature set (``errno`` kept for
    ``ctypes.get_errno``), or None off Linux or where the library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    library = _c_library()
    if library is None:
        return None
    try:
        fn = library[name]  # a function object of its own: callers set their own signatures
    except AttributeError:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
