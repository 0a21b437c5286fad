"""The sampling parameters a run's sampler applies, in vLLM's `SamplingParams` names: one typed
setting read by the simulator's pricing (engine/pricing/sampling_ops.py) and validated for the
torch executor's samplers (engine/torch_exec/settings.py) alike."""

from __future__ import annotations

from dataclasses import dataclass

from engine.base.errors import bad_value


@dataclass(frozen=True)
class SamplerSettings:
    """What a run's sampler does: vLLM's `SamplingParams` names and off values (`executor.*`)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise bad_value("executor.temperature", self.temperature, "must be >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad_value("executor.top_k", self.top_k, "must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise bad_value("executor.top_p", self.top_p, "must be in (0, 1]")
        if not self.repetition_penalty > 0:
            raise bad_value("executor.repetition_penalty", self.repetition_penalty, "must be > 0 (1.0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def top_k_top_p(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0
