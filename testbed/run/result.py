"""What a run leaves in memory: `RunResult`, and `RunInterrupted` carrying a partial one.

Its own module so that the writers of results (testbed/run/outputs.py, testbed/tracking/tracker.py) and the
runner that makes them (testbed/run/runner.py) import it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.trace import Tracer
from testbed.config.spec import RunSpec


@dataclass
class RunResult:
    spec: RunSpec
    summary: dict
    requests: list[dict]
    microbatches: list[dict]
    tracer: Tracer
    stage_tracks: list[str]
    info: dict = field(default_factory=dict)  # wall time, memory: not deterministic, kept out of summary
    error: str | None = None
    breakdown: dict | None = None  # where each stage's time went (engine/core/breakdown.py)

    @property
    def failed(self) -> bool:
        return self.error is not None



class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a run, with the partial result (a KeyboardInterrupt, so callers
    that stop on Ctrl-C keep doing so)."""

    def __init__(self, result: RunResult, signal: str) -> None:
        super().__init__(signal)
        self.result, self.signal = result, signal


__all__ = ["RunResult", "RunInterrupted"]
