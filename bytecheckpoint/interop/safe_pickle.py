"""A restricted unpickler: only the globals a format names are admitted, as inert stand-ins.

The standard unpickler imports and calls whatever a pickle names (``os.system`` in a
``__reduce__``), so a pickle from an untrusted checkpoint must never reach it. Here every
global goes through :meth:`SafeUnpickler.find_class`, which returns the stand-in registered for
that exact ``module.name`` (a plain function or record class of this module, never the real
class) and refuses anything else with :class:`UnsafePickleError` naming it. Persistent ids (the
storages of a ``torch.save`` file) are refused unless the caller supplies a handler.
"""

from __future__ import annotations

import io
import pickle
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import UnsafeCheckpointError

# A pickle larger than this is not metadata anyone writes; refuse before reading it.
MAX_PICKLE_BYTES = 1 << 30
# The most elements a plain value may unfold to, counting a shared reference once per use (as
# every later reader walks it): a pickle of a few hundred bytes can share its way to 2**40.
MAX_PLAIN_NODES = 1_000_000


class UnsafePickleError(UnsafeCheckpointError):
    """A pickle names a class or function outside the admitted list (it could run code)."""

    def __init__(self, message: str, global_name: str | None = None) -> None:
        super().__init__(message)
        self.global_name = global_name  # "module.name" the pickle named, when that was the refusal


class Record:
    """The stand-in of an admitted class: keeps its constructor arguments and pickled state
    as plain data (``args``, ``state``), runs none of the real class's code."""

    qualname = "Record"
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> Record:
        # Both REDUCE (a call) and NEWOBJ (``cls.__new__``) land here.
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        """A field of a dataclass-like state (a dict, or a (dict, slots) pair)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            return state.get(name, default)
        return default

    def __repr__(self) -> str:
        return short(self)


def record_class(qualname: str) -> type[Record]:
    """A fresh Record subclass standing in for ``qualname`` (so ``isinstance`` tells them apart).
    Callers build their stand-ins per load: a pickle may set attributes on the stand-ins it
    names (BUILD), and that must not outlive the one load."""
    return type(f"Record[{qualname}]", (Record,), {"qualname": qualname})


class SafeUnpickler(pickle.Unpickler):
    """Unpickles with the globals in ``allowed`` (``"module.name"`` -> stand-in) only."""

    def __init__(self, data: bytes, allowed: Mapping[str, Any], *, source: str,
                 persistent: Callable[[Any], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._source = source
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        stand_in = self._allowed.get(f"{module}.{name}")
        if stand_in is None:
            raise UnsafePickleError(
                f"{self._source}: the pickle names {module}.{name}, which is not among the classes "
                "this format may hold; refusing to load it (it could run code). Only load it with "
                "PyTorch's own tools if you trust where it came from", f"{module}.{name}"
            )
        return stand_in

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError(f"{self._source}: the pickle refers to external data "
                                    f"({_short(pid)}), which this value may not hold")
        return self._persistent(pid)


def safe_loads(data: bytes, allowed: Mapping[str, Any], *, source: str,
               persistent: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle ``data`` with only ``allowed`` globals; any other failure is a named error."""
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafeCheckpointError(f"{source}: a pickle of {len(data)} bytes is over the limit "
                                    f"of {MAX_PICKLE_BYTES}; refusing to decode it")
    try:
        return SafeUnpickler(data, allowed, source=source, persistent=persistent).load()
    except UnsafeCheckpointError:
        raise
    except RecursionError as exc:
        raise UnsafeCheckpointError(f"{source}: the pickle nests too deeply to decode") from exc
    except Exception as exc:  # truncated or garbled: pickle raises many unrelated types
        raise UnsafeCheckpointError(f"{source}: not a readable pickle ({_short(exc)})") from exc


def plain_globals() -> dict[str, Any]:
    """Stand-ins for plain values: OrderedDict (torch.save writes one for tensor hooks) becomes
    a dict. Fresh per load (see :func:`record_class`)."""

    def ordered_dict(*args: Any) -> dict[Any, Any]:
        return dict(*args)

    def encode(text: Any = "", encoding: Any = "latin1") -> bytes:
        # Pickle protocol 2 (torch.save's) writes bytes as _codecs.encode(str, "latin1"), so a
        # bytes value (torchtitan's pickled dataloader state) needs it; nothing else is encoded.
        if type(text) is not str or encoding not in ("latin1", "latin-1"):
            raise UnsafePickleError(f"_codecs.encode({_short(text)}, {_short(encoding)}) is not how "
                                    "pickle writes bytes", "_codecs.encode")
        return text.encode("latin-1")

    return {"collections.OrderedDict": ordered_dict, "_codecs.encode": encode}

_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)


class PlainValueTooLargeError(UnsafeCheckpointError):
    """An unpickled value that unfolds to more than ``MAX_PLAIN_NODES`` elements (shared or
    cyclic references counted once per use): no reader could walk it in bounded time."""


def is_plain(value: Any, *, budget: int = MAX_PLAIN_NODES) -> bool:
    """True for None/bool/int/float/str/bytes and lists, tuples and str/int-keyed dicts of them,
    at most 64 levels deep. Raises :class:`PlainValueTooLargeError` past ``budget`` elements."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > budget:
            raise PlainValueTooLargeError(
                f"the value unfolds to over {budget} elements (shared references such as "
                "x = [x, x] count once per use): too large; save it without shared references")
        if depth > 64:
            return False
        if isinstance(item, _PLAIN_TYPES):
            continue
        if isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, dict):
            if not all(isinstance(k, str | int) for k in item):
                return False
            stack.extend((v, depth + 1) for v in item.values())
        else:
            return False
    return True


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr (a few levels, a few items each), through Records too."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 4
        self.maxdeque = self.maxarray = 4
        self.maxstring = self.maxother = self.maxlong = 60

    def repr_instance(self, x: Any, level: int) -> str:
        if isinstance(x, Record):
            if level <= 0:
                return f"<{x.qualname} ...>"
            return (f"<{x.qualname} args={self.repr1(getattr(x, 'args', ()), level - 1)} "
                    f"state={self.repr1(getattr(x, 'state', None), level - 1)}>")
        if isinstance(x, str | bytes | bytearray):  # subclasses (tokens): bounded like str
            return self.repr_str(str(x) if isinstance(x, str) else bytes(x[:200]), level)
        return super().repr_instance(x, level)

    def repr_bytes(self, x: bytes, level: int) -> str:
        text = repr(x[: self.maxstring])
        return text if len(x) <= self.maxstring else f"{text}..."


_SHORT = _ShortRepr()


def short(value: Any, limit: int = 80) -> str:
    """A repr of ``value`` of at most ``limit`` characters, in time bounded whatever its size or
    sharing (a full repr of a shared structure x = [x, x] nested 40 deep never ends)."""
    try:
        text = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 (a repr must not fail an error message)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


_short = short
