"""Credentials out of anything shown to a person: error messages, logs, events.

A URL or DSN may carry a password (``http://user:pass@host``) or a secret in its query
(``?password=...``, ``&secret_key=...``); :func:`redact` masks both wherever they appear in a
text, so a message can quote the URL it is about without leaking what lets one use it.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@  (the password is everything up to the last '@' before the host)
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@'\"]*):(?P<secret>[^/\s'\"]*)@")
# ?password=x / &secret_key=x / ;token=x
_QUERY = re.compile(
    r"(?P<head>[?&;](?:[A-Za-z0-9_\-]*(?:password|passwd|pwd|secret|token|key|signature|credential)"
    r"[A-Za-z0-9_\-]*)=)(?P<secret>[^&;\s'\"]*)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` and the value of every
    secret-looking query parameter replaced by ``***``."""
    text = str(text)
    if "@" not in text and "=" not in text:
        return text  # nothing to mask: the common case, kept cheap for per-operation events
    text = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", text)
