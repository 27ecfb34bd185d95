"""Settings of the cooling service: command line over environment over a TOML file.

    [tiering]                     # environment variable
    hot = "/ssd/ckpt"             # BCP_TIERING_HOT      hot root (checkpoints of every run below it)
    cold = "/hdd/ckpt"            # BCP_TIERING_COLD     cold root (a mirror of the hot tree)
    cool_after = "7d"             # BCP_TIERING_COOL_AFTER   age since last modification / commit
    keep_newest = 2               # BCP_TIERING_KEEP_NEWEST  newest N of each run stay hot
    delete_after = "90d"          # BCP_TIERING_DELETE_AFTER optional retention (off if unset)
    keep_every = 1000             # BCP_TIERING_KEEP_EVERY   retention keeps steps divisible by k
    interval = "1h"               # BCP_TIERING_INTERVAL     loop mode
    cold_policy = "COLD"          # BCP_TIERING_COLD_POLICY  HDFS mode: the policy cooled paths get

HDFS mode: ``hot = "hdfs://namenode:8020/ckpt"`` and no ``cold``; cooling sets the storage
policy and runs the HDFS Mover (see :mod:`storage_tiering.hdfs`).

The file is named by ``--config`` or ``BCP_TIERING_CONFIG``. Durations are seconds or a
number with ``s``, ``m``, ``h`` or ``d``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from bytecheckpoint.storage.redact import redact

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

CONFIG_ENV = "BCP_TIERING_CONFIG"
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*$")


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the setting and where it came from
    (with any password in a quoted URL masked: tier URLs may carry credentials)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


@dataclass(frozen=True)
class TieringConfig:
    hot: str = ""
    cold: str = ""
    cool_after: float = 7 * 86400.0
    keep_newest: int = 2
    delete_after: float | None = None
    keep_every: int = 0
    interval: float = 3600.0
    cold_policy: str = "COLD"

    @property
    def mode(self) -> str:
        """``"local"`` (two directories, links) or ``"hdfs"`` (storage policies)."""
        return "hdfs" if self.hot.split("://", 1)[0].startswith("hdfs") and "://" in self.hot else "local"

    def validate(self) -> TieringConfig:
        if not self.hot:
            raise ConfigError("no hot tier: pass --hot or set BCP_TIERING_HOT")
        if self.mode == "hdfs":
            if self.cold:
                raise ConfigError(f"HDFS mode cools in place (storage policy {self.cold_policy}); "
                                  f"drop the cold tier {self.cold!r}")
            return self._check_policy()
        if "://" in self.hot and not self.hot.startswith("file://"):
            raise ConfigError(f"hot tier {self.hot!r}: only local directories (links) and hdfs:// "
                              "(storage policies) can be cooled; on S3 use a bucket lifecycle rule")
        if not self.cold:
            raise ConfigError("no cold tier: pass --cold or set BCP_TIERING_COLD")
        if "://" in self.cold and not self.cold.startswith("file://"):
            raise ConfigError(f"cold tier {self.cold!r}: the cold tier must be a local directory "
                              "or mount (the hot path links to it)")
        hot, cold = _abs(self.hot), _abs(self.cold)
        _check_hot_root(hot)
        check_apart(hot, cold)
        return replace(self._check_policy(), hot=hot, cold=cold)

    def _check_policy(self) -> TieringConfig:
        if self.interval <= 0:  # --loop would run pass after pass without a pause
            raise ConfigError(f"interval {self.interval:g}s: give a time between passes above 0")
        if self.keep_newest < 0 or self.keep_every < 0:
            raise ConfigError("keep_newest and keep_every must be >= 0")
        if self.delete_after is not None and self.keep_newest < 1:
            # A run whose latest pointer is missing would lose every checkpoint it has.
            raise ConfigError("keep_newest=0 with delete_after set would let retention delete every "
                              "checkpoint of a run; keep at least the newest (keep_newest >= 1)")
        if self.delete_after is not None and self.delete_after < self.cool_after:
            raise ConfigError(f"delete_after ({self.delete_after:g}s) is shorter than cool_after "
                              f"({self.cool_after:g}s)")
        return self


def _abs(path: str) -> str:
    return os.path.abspath(path.removeprefix("file://"))


def check_apart(hot: str, cold: str) -> None:
    """Neither tier may contain the other, as given or through symlinks (real paths): a cold
    tier inside the hot one is scanned as checkpoints of its own, and retention would delete
    the cold copies that hot links (a pinned checkpoint's too) point to."""
    hot, cold = os.path.abspath(hot), os.path.abspath(cold)
    for h, c in ((hot, cold), (os.path.realpath(hot), os.path.realpath(cold))):
        if os.path.commonpath([h, c]) in (h, c):
            via = "" if (h, c) == (hot, cold) else f" (real paths of {hot} and {cold})"
            raise ConfigError(f"hot tier {h} and cold tier {c} must not contain each other{via}: give "
                              "two separate directories")


def _check_hot_root(hot: str) -> None:
    """Refuse the file system root and the home directory as the hot tier: a pass would scan
    (and, with delete_after, retire) every checkpoint on the machine (bcp gc refuses them too)."""
    real = os.path.realpath(hot)
    if real in (os.path.realpath(os.sep), os.path.realpath(os.path.expanduser("~"))):
        raise ConfigError(f"hot tier {real} is the file system root or the home directory: give the "
                          "directory that holds the runs' checkpoints")


def parse_duration(value: Any, name: str = "duration") -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(f"{name}: {value!r} is not a duration (e.g. 3600, 90m, 12h, 7d)")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds):  # TOML allows nan and inf: never or always due
        raise ConfigError(f"{name}: {value!r} is not a finite duration")
    if seconds < 0:
        raise ConfigError(f"{name}: {value!r} is negative")
    return seconds


def _coerce(name: str, value: Any, source: str) -> Any:
    label = f"{name} (from {source})"
    if name in ("cool_after", "interval"):
        return parse_duration(value, label)
    if name == "delete_after":
        return None if value in (None, "", "off", "none") else parse_duration(value, label)
    if name in ("keep_newest", "keep_every"):
        # int() would take true as 1 and 2.7 as 2: a typo must fail, not change the policy.
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{label}: {value!r} is not an integer")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{label}: {value!r} is not an integer") from None
    if not isinstance(value, str):
        raise ConfigError(f"{label}: {value!r} is not a string")
    return value


def load_config(path: str | None = None, env: Mapping[str, str] | None = None,
                **overrides: Any) -> TieringConfig:
    """Build the settings: ``overrides`` (None values ignored) over ``env`` over the file."""
    env = os.environ if env is None else env
    names = [f.name for f in fields(TieringConfig)]
    values: dict[str, Any] = {}
    path = path or env.get(CONFIG_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read tiering config {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"tiering config {path} is not valid TOML: {exc}") from None
        section = doc.get("tiering", doc)
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: [tiering] must be a table of settings, not {section!r}")
        unknown = set(section) - set(names)
        if unknown:
            raise ConfigError(f"{path}: unknown settings {sorted(unknown)}; known: {names}")
        values.update({k: _coerce(k, v, path) for k, v in section.items()})
    for name in names:
        var = f"BCP_TIERING_{name.upper()}"
        if env.get(var, "") != "":
            values[name] = _coerce(name, env[var], var)
    for name, value in overrides.items():
        if name not in names:
            raise TypeError(f"unknown tiering setting {name!r}")
        if value is not None:
            values[name] = _coerce(name, value, "command line")
    return TieringConfig(**values).validate()
