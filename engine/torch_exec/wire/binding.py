"""What binds a control frame to one run, sender, receiver and moment (engine/torch_exec/wire/messages.py
signs it): without it a captured frame could be replayed (one replayed `done` or `hello` killed a
run). The binding is [run, sender, receiver, counter]; a receiver refuses a frame for someone
else (the direction), for another run, or whose counter it has already seen from that sender.
Counters are checked against a window, not for strict order: frames of different threads of
one sender may interleave on their way."""
from __future__ import annotations

import os
import secrets
import typing

REPLAY_WINDOW = 1 << 16  # counters this far below a sender's highest are refused outright
GROUPS = {"stage": "stages", "sampler": "samplers"}  # name prefix -> the group it also answers to


# The run's shared secret (engine/torch_exec/wire/messages.py's module docstring: how external stages get it).
SECRET_ENV = "TESTBED_STAGE_SECRET"
SECRET_FILE_ENV = "TESTBED_STAGE_SECRET_FILE"
SECRET_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def secret_from_env(environ: typing.Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret of external stages (see the module docstring), or None if unset."""
    env = os.environ if environ is None else environ
    text = env.get(SECRET_ENV)
    if not text and env.get(SECRET_FILE_ENV):
        with open(env[SECRET_FILE_ENV], encoding="ascii") as fh:
            text = fh.read()
    if not text:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{SECRET_ENV} must be hex digits") from None
    if len(key) < 16:
        raise ValueError(f"{SECRET_ENV} must hold at least 16 bytes (32 hex digits); got {len(key)}")
    return key


class WireError(ValueError):
    """A frame that is not an authentic, well-formed message (dropped by the receiver)."""


def new_run_id() -> str:
    return secrets.token_hex(8)


def receiver_names(me: str) -> set[str]:
    """The receiver names `me` answers to: itself and its group (`stage3` -> `stages`)."""
    group = next((g for prefix, g in GROUPS.items() if me.startswith(prefix) and me[len(prefix):].isdigit()), None)
    return {me} | ({group} if group else set())


class Window:
    """The counters seen from one sender: a frame is fresh if its counter is new and not more
    than REPLAY_WINDOW below the highest seen."""

    def __init__(self) -> None:
        self.high = 0
        self.seen: set[int] = set()

    def fresh(self, n: int) -> bool:
        return n > self.high - REPLAY_WINDOW and n not in self.seen

    def add(self, n: int) -> None:
        self.seen.add(n)
        self.high = max(self.high, n)
        if len(self.seen) > 2 * REPLAY_WINDOW:
            self.seen = {c for c in self.seen if c > self.high - REPLAY_WINDOW}


def check_binding(binding, names: set[str], run: str, me: str, run_optional: bool = False) -> tuple[str, str, int]:
    """(run, sender, counter) of a well-formed binding meant for `names` in `run` ("" = any);
    `run_optional`: a frame with no run is accepted too (external stages' hello). Raises WireError."""
    if (type(binding) is not list or len(binding) != 4 or not all(type(x) is str for x in binding[:3])
            or type(binding[3]) is not int):
        raise WireError("a binding is [run, sender, receiver, counter]")
    frame_run, sender, to, n = binding
    if to not in names:
        raise WireError(f"frame for {to[:40]!r}, not for {me!r} (wrong direction)")
    if run and frame_run != run and not (frame_run == "" and run_optional):
        raise WireError("frame of another run")
    if n < 1:
        raise WireError("counter must be positive")
    return frame_run, sender, n
