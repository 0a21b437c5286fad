"""Parsing of the human-written quantities in configs: link bandwidths and durations.

Bandwidth strings follow the networking convention that the case of the base letter decides:
`b` (or `bit`) is a bit and `B` (or `byte`) is a byte, so "100Mbps" is 100e6 bits/s = 12.5e6 B/s and
"20.8GB/s" is 20.8e9 B/s. Decimal prefixes k/M/G/T (case-insensitive: nobody means milli-bits)
are powers of 1000; binary prefixes Ki/Mi/Gi/Ti are powers of 1024. A bare number (or numeric
string) is already bytes per second. Everything is returned in SI base units as floats: bytes per
second and seconds, the units the cost model and the simulator use internally.
"""
from __future__ import annotations

import math
import re

from engine.base.errors import ConfigError

__all__ = ["parse_bandwidth", "parse_duration", "format_bandwidth", "format_duration"]

_BANDWIDTH_UNITS = (
    "a number (bytes/s) or <number><prefix><b|bit|B|byte><ps|/s>, prefixes k M G T (x1000) or "
    "Ki Mi Gi Ti (x1024), b/bit = bits and B/byte = bytes: e.g. 100Mbps, 73.3Gbps, 20.8GB/s, 25GiB/s"
)
_DURATION_UNITS = "a number (seconds) or <number><ns|us|ms|s|min|h>: e.g. 30ms, 10us, 1.5s"

_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_BANDWIDTH_RE = re.compile(
    r"^\s*" + _NUMBER + r"\s*([kKmMgGtT]i?)?\s*([Bb]its?|[Bb]ytes?|b|B)\s*(ps|/s|/sec)\s*$"
)
_DURATION_RE = re.compile(r"^\s*" + _NUMBER + r"\s*(ns|us|µs|μs|ms|s|sec|secs|min|h)?\s*$")

_DECIMAL = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"k": 2.0**10, "m": 2.0**20, "g": 2.0**30, "t": 2.0**40}
_DURATION_SCALE = {
    None: 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6,
    "ns": 1e-9, "min": 60.0, "h": 3600.0,
}


def _as_number(value: object, key: str, accepted: str) -> float | None:
    """A plain int/float (not bool) as float; None if `value` is a string to parse."""
    if isinstance(value, bool):
        raise ConfigError(f"invalid {key}={value!r}: expected {accepted}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return None
    raise ConfigError(f"invalid {key}={value!r}: expected {accepted}")


def _check(result: float, value: object, key: str, accepted: str, allow_zero: bool) -> float:
    if math.isnan(result) or math.isinf(result):
        raise ConfigError(f"invalid {key}={value!r}: must be finite; expected {accepted}")
    if result < 0 or (result == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"invalid {key}={value!r}: must be {need}; expected {accepted}")
    return result


def parse_bandwidth(value: object, key: str = "bandwidth") -> float:
    """Bytes per second from "100Mbps", "73.3Gbps", "20.8GB/s", "25GiB/s", "12.5 MB/s" or a number.

    `key` names the config entry in error messages. Zero, negative and non-finite values are
    rejected: a link with no bandwidth never delivers, so it is always a configuration mistake.
    """
    number = _as_number(value, key, _BANDWIDTH_UNITS)
    if number is None:
        text = str(value)
        match = _BANDWIDTH_RE.match(text)
        if match is None:
            try:  # a bare numeric string: bytes per second, like a bare number
                number = float(text.strip())
            except ValueError:
                raise ConfigError(f"invalid {key}={value!r}: expected {_BANDWIDTH_UNITS}") from None
        else:
            mantissa, prefix, base, _per_second = match.groups()
            number = float(mantissa)
            if prefix:
                table = _BINARY if prefix.endswith("i") else _DECIMAL
                number *= table[prefix[0].lower()]
            if base == "b" or base.lower().startswith("bit"):  # bits, not bytes
                number /= 8.0
    return _check(number, value, key, _BANDWIDTH_UNITS, allow_zero=False)


def parse_duration(value: object, key: str = "duration") -> float:
    """Seconds from "30ms", "10us", "1.5s", "2min" or a number (seconds). Zero is allowed."""
    number = _as_number(value, key, _DURATION_UNITS)
    if number is None:
        match = _DURATION_RE.match(str(value))
        if match is None:
            raise ConfigError(f"invalid {key}={value!r}: expected {_DURATION_UNITS}")
        mantissa, unit = match.groups()
        number = float(mantissa) * _DURATION_SCALE[unit]
    return _check(number, value, key, _DURATION_UNITS, allow_zero=True)


def format_bandwidth(bytes_per_s: float) -> str:
    """Short human form for reports, in bytes: 20.8e9 -> '20.8 GB/s'."""
    for scale, unit in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def format_duration(seconds: float) -> str:
    """Short human form for reports: 0.0123 -> '12.3 ms'."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"
