"""User-facing errors: the CLI prints `error: <message>` on one line and exits with code 2.

Anything raised as a `TestbedError` is a user mistake or an impossible request (unknown name,
bad value, missing data, a model that does not fit). Everything else is a bug and keeps its
traceback.
"""
from __future__ import annotations

from collections.abc import Iterable


class TestbedError(Exception):
    """A problem the user can fix; the message names the bad value and what would be valid."""

    __test__ = False  # not a pytest test class despite the name


class ConfigError(TestbedError):
    """A configuration value is unknown or out of range."""


class DataNotFoundError(TestbedError):
    """A workload file could not be found (the message lists where we looked)."""


class ImpossibleFitError(TestbedError):
    """The model does not fit the stages' memory, or a request can never fit the KV cache."""


class RunFailedError(TestbedError):
    """A run could not complete (e.g. a stage process died); the message names the cause."""


def unknown_choice(kind: str, value: object, choices: Iterable[str]) -> ConfigError:
    """The one wording for every 'no such name' error, so users learn to read it once."""
    valid = ", ".join(sorted(choices))
    return ConfigError(f"unknown {kind} {value!r}; valid choices: {valid}")


def bad_value(key: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"invalid {key}={value!r}: {expected}")
