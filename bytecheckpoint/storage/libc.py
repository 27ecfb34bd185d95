"""Functions of the C library that Python's ``os`` module lacks, looked up through ctypes."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: str, b: str, *, a_dir: int = _AT_FDCWD, b_dir: int = _AT_FDCWD) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one step (``renameat2(RENAME_EXCHANGE)``):
    at every moment each path names one of the two. False where the C library or the file
    system cannot (the caller then renames in two steps); raises OSError for anything else.
    ``a_dir`` / ``b_dir``: directory descriptors relative paths are taken in (``dir_fd``)."""
    if "\0" in a or "\0" in b:  # a C string would end there, naming another path
        raise ValueError(f"embedded null byte in {a!r} or {b!r}")
    fn = function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                ctypes.c_uint], ctypes.c_int)
    if fn is None:
        return False
    if fn(a_dir, os.fsencode(a), b_dir, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)
