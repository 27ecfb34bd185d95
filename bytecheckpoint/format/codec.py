"""A safe codec for the non-tensor parts of a state: msgpack with a few typed extensions.

Optimizer hyper-parameters, RNG states, step counters and user dicts are packed into
compact bytes. Decoding never executes code (no pickle): only the types below come back.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError
from .dtypes import byte_view, check_storable, dtype_from_name, dtype_name

_EXT_TUPLE = 1
_EXT_TENSOR = 2
_EXT_NDARRAY = 3
_EXT_INTKEY_DICT = 4
_EXT_BIGINT = 5
_EXT_DTYPE = 6


def _default(obj: Any, depth: int) -> msgpack.ExtType:
    if isinstance(obj, tuple | torch.Tensor | np.ndarray | dict):
        _check_depth(depth)
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj), depth + 1))
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"cannot store a {type(obj).__name__} inside non-tensor state; "
                "put sharded tensors in a module or optimizer, or call .full_tensor() first"
            )
        check_storable(obj)
        t = obj.detach().to("cpu").contiguous()
        raw = byte_view(t).numpy().tobytes() if t.numel() else b""
        return msgpack.ExtType(_EXT_TENSOR, _pack([dtype_name(t.dtype), list(t.shape), raw], depth + 1))
    if isinstance(obj, np.ndarray):
        # ascontiguousarray makes a 0-d array 1-d: the shape stored is the array's own
        a = np.ascontiguousarray(obj)
        if a.dtype.hasobject:
            raise UnsupportedStateError("numpy object arrays cannot be stored safely")
        if a.dtype.kind == "V":  # structured or raw void: no load could decode it
            raise UnsupportedStateError(
                f"numpy arrays of structured or void dtype ({a.dtype}) cannot be stored: store "
                "each field as its own array")
        return msgpack.ExtType(_EXT_NDARRAY, _pack([a.dtype.str, list(obj.shape), a.tobytes()], depth + 1))
    if isinstance(obj, np.generic):
        return _numpy_scalar(obj)
    if isinstance(obj, dict):
        # Non-string keys (e.g. optimizer param ids) need their own tag.
        return msgpack.ExtType(_EXT_INTKEY_DICT, _pack([[k, v] for k, v in obj.items()], depth + 1))
    if isinstance(obj, int):
        return msgpack.ExtType(_EXT_BIGINT, _decimal(obj))
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(_EXT_DTYPE, dtype_name(obj).encode())
    raise UnsupportedStateError(
        f"cannot store a value of type {type(obj).__module__}.{type(obj).__qualname__}; "
        "supported: None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor, "
        "numpy arrays"
    )


def _decimal(obj: int) -> bytes:
    """The digits of an int outside msgpack's 64 bits, or of an int subclass (an IntEnum):
    ``int.__repr__``, as ``str()`` of a subclass may be its name, which no load could read."""
    try:
        return int.__repr__(obj).encode()
    except ValueError:  # past sys.get_int_max_str_digits(): no load could parse it either
        raise UnsupportedStateError(
            f"an int of {obj.bit_length()} bits has more decimal digits than Python converts "
            "(sys.get_int_max_str_digits()); store it as bytes (int.to_bytes)") from None


def _pack(obj: Any, depth: int = 0) -> bytes:
    return msgpack.packb(obj, default=lambda o: _default(o, depth), use_bin_type=True,
                         strict_types=True)


# Extension values nest (a tuple in a dict in a tuple...), and each level is decoded by a
# fresh C unpacker on the C stack: a few hundred levels of hostile input crashed the process
# (SIGSEGV). Real state nests a handful of levels (an RNG state: a tuple in a tuple).
MAX_DEPTH = 32
_MAX_NDIM = 64


def _check_depth(depth: int) -> None:
    """Refuse at save what every load would refuse as damaged (``_ext_hook``'s limit): the
    checkpoint would be committed and never load."""
    if depth >= MAX_DEPTH:
        raise UnsupportedStateError(
            f"a value in the state nests more than {MAX_DEPTH} levels of tuples, tensors, numpy "
            "arrays and dict subclasses (OrderedDict); flatten it, or use lists and plain dicts "
            "for the outer levels")


# Numpy scalar kinds whose ``item()`` is a bool, int, float, str or bytes of exactly its value.
_EXACT_SCALAR_KINDS = frozenset("biufSU")


def _numpy_scalar(obj: np.generic) -> Any:
    """A numpy scalar is stored as the Python value it equals (a load into a target that holds
    a numpy scalar there gets its dtype back). One with no such value (long double, complex,
    datetime, void) is refused: ``item()`` gave a lossy float, a unitless int or a type the
    codec cannot store."""
    value = obj.item()
    if obj.dtype.kind in _EXACT_SCALAR_KINDS and type(value) in (bool, int, float, str, bytes):
        return value
    raise UnsupportedStateError(
        f"cannot store a numpy scalar of dtype {obj.dtype} exactly as a plain value; store it "
        "as a 0-d numpy array (numpy.asarray(x)), which keeps its dtype")


def _ext_hook(code: int, data: bytes, depth: int) -> Any:
    if code == _EXT_BIGINT:
        return int(data.decode())
    if code == _EXT_DTYPE:
        return dtype_from_name(data.decode())
    if code not in (_EXT_TUPLE, _EXT_TENSOR, _EXT_NDARRAY, _EXT_INTKEY_DICT):
        raise CorruptCheckpointError(f"unknown extension type {code} in stored object state")
    if depth >= MAX_DEPTH:  # checked before recursing
        raise CorruptCheckpointError(
            f"stored object state nests deeper than {MAX_DEPTH} levels of tuples, dicts and arrays; "
            "it is damaged or hostile"
        )
    value = _unpack(data, depth + 1)
    if code == _EXT_TUPLE:
        return tuple(value)
    if code == _EXT_INTKEY_DICT:
        return dict(value)
    dtype, shape, raw = value
    shape = _shape(shape, len(raw))
    if code == _EXT_TENSOR:
        torch_dtype = dtype_from_name(dtype)
        if math.prod(shape) * torch_dtype.itemsize != len(raw):
            raise CorruptCheckpointError(f"stored tensor of shape {shape} and dtype {dtype} has "
                                         f"{len(raw)} bytes")
        if not raw:
            return torch.empty(shape, dtype=torch_dtype)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return flat.view(torch_dtype).reshape(shape)
    if type(dtype) is not str:
        raise CorruptCheckpointError(f"stored numpy array has a malformed dtype {dtype!r:.80}")
    np_dtype = np.dtype(dtype)
    if np_dtype.kind not in _NUMPY_KINDS or np_dtype.fields is not None or np_dtype.subdtype is not None:
        raise CorruptCheckpointError(f"stored numpy array claims dtype {dtype!r}, which is not a plain "
                                     "number, string or time type")
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape).copy()


_NUMPY_KINDS = frozenset("biufcSUmM")  # never "O" (objects) or "V" (raw / structured)


def _shape(shape: Any, nbytes: int) -> tuple[int, ...]:
    """A stored shape: a short list of non-negative ints whose product is checked against the
    stored bytes by the caller (before anything is allocated)."""
    if type(shape) is not list or len(shape) > _MAX_NDIM or not all(
            type(d) is int and 0 <= d <= 1 << 62 for d in shape):
        raise CorruptCheckpointError(f"stored array has a malformed shape {shape!r:.80}")
    if math.prod(shape) > max(nbytes, 1) * 8:  # more elements than bytes could ever hold
        raise CorruptCheckpointError(f"stored array of shape {tuple(shape)} holds only {nbytes} bytes")
    return tuple(shape)


def _unpack(data: bytes, depth: int = 0) -> Any:
    return msgpack.unpackb(data, ext_hook=lambda code, raw: _ext_hook(code, raw, depth), raw=False,
                           strict_map_key=False)


def encode(obj: Any) -> bytes:
    """Pack a tree of plain Python values, tensors and arrays into bytes."""
    try:
        return _pack(obj)
    except UnicodeEncodeError as exc:  # a str holding a lone surrogate has no UTF-8 form
        raise UnsupportedStateError(
            f"a string in the state cannot be stored as UTF-8 ({exc.reason} at position "
            f"{exc.start} of {exc.object[max(0, exc.start - 20):exc.end + 20]!r}); store it as "
            "bytes, or encode it with errors='surrogatepass' yourself") from None
    except (RecursionError, ValueError) as exc:  # msgpack: "recursion limit exceeded"
        if isinstance(exc, ValueError) and "recursion limit" not in str(exc):
            raise
        raise UnsupportedStateError(
            "a value in the state nests too deeply to store (about 1000 levels of lists and dicts), "
            "or holds itself (a list or dict that contains itself); store a flat form") from None


def decode(data: bytes) -> Any:
    """Unpack bytes made by :func:`encode`; raises CorruptCheckpointError on bad input."""
    try:
        return _unpack(data)
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptCheckpointError(f"stored object state cannot be decoded: {exc}") from exc
