"""Dtype names used in the metadata and their safetensors codes (an explicit allowlist)."""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError

# name in our metadata -> (torch dtype, safetensors dtype code)
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint64": (torch.uint64, "U64"),
    "uint32": (torch.uint32, "U32"),
    "uint16": (torch.uint16, "U16"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
    "complex64": (torch.complex64, "C64"),
    "complex128": (torch.complex128, "U8"),  # safetensors has no C128: raw bytes
}
_BY_TORCH = {t: name for name, (t, _) in _DTYPES.items()}
DTYPE_NAMES = frozenset(_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedStateError(f"dtype {dtype} cannot be checkpointed") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name][0]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint") from None


def safetensors_code(name: str) -> str:
    try:
        return _DTYPES[name][1]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint") from None


def itemsize(name: str) -> int:
    return dtype_from_name(name).itemsize


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (contiguous, on the CPU) as a flat ``uint8`` view. A tensor of one
    element counts as contiguous whatever its stride (``x[::2]`` of two elements, a column of
    one row), and ``view(torch.uint8)`` refused it with a raw error: that one element is
    viewed through a stride of 1 instead. A lazily conjugated or negated view (``x.conj()``)
    is resolved first (a copy): its bytes are not its values. Sparse and nested tensors have
    no such bytes: a named error."""
    check_storable(t)
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def check_storable(t: torch.Tensor) -> None:
    """Refuse, by name, tensors whose values are not one strided block of elements."""
    if t.is_nested or t.layout != torch.strided:
        kind = "nested" if t.is_nested else f"{t.layout}".replace("torch.", "")
        raise UnsupportedStateError(
            f"a {kind} tensor ({t.dtype}, shape {tuple(t.shape) if not t.is_nested else '(nested)'}) "
            "cannot be checkpointed: store a dense tensor (.to_dense()), or its parts as "
            "separate tensors")
