"""Credentials never leave the process: a password in a tracking or storage URI
(`postgresql://user:secret@host/db`, `https://token@host`) is replaced by `***` wherever a URI is
stored or shown -- MLflow params, config.yaml, tags, report.json, printed lines.

Only the user-info part before '@' is touched; everything else in the value stays as written, so
a redacted config still says which server and database a run used.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# scheme://user:password@ or scheme://token@ ; the password runs to the last '@' before the path
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*)(?P<pw>:[^/\s]*)?@")


# libpq also takes the password as a query parameter: postgresql://user@host/db?password=secret
_QUERY = re.compile(r"(?P<key>[?&](?:password|passwd|pwd)=)[^&\s]*", re.IGNORECASE)


def redact(value: Any) -> Any:
    """`value` with any URI password (or bare token) replaced by `***`; non-strings unchanged."""
    if not isinstance(value, str):
        return value
    if "=" in value:
        value = _QUERY.sub(lambda m: f"{m.group('key')}***", value)
    if "@" not in value:
        return value
    return _USERINFO.sub(_hide, value)


def _hide(m: re.Match) -> str:
    if m.group("pw") is None:  # a bare token (https://token@host) is a secret; a user name is not worth the doubt
        return f"{m.group('scheme')}***@"
    return f"{m.group('scheme')}{m.group('user')}:***@"


def redacted(cfg: Any) -> Any:
    """A copy of a config (nested mappings and lists) with every string passed through `redact`."""
    if isinstance(cfg, Mapping):
        return {k: redacted(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [redacted(v) for v in cfg]
    return redact(cfg)
