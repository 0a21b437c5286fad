"""SiPipe: continuous batching on a CPU-assisted pipeline runtime (arXiv 2506.22033; docs/policies-specialised.md#sipipe).

SiPipe changes the runtime, not the batching: its scheduler is continuous batching with chunked
prefill (Sarathi-style hybrid micro-batches under a token budget) at batch size 512, and it asks
the executor for all three runtime fixes (`RuntimeFeatures`): CPU sampling, overlapped input
preparation (double buffer) and structure-aware transfer. Each stays a `runtime.*=` switch, so
the ablation turns one off at a time, and any other policy may turn them on.

Sampling settings (temperature, top-k/top-p, repetition/presence/frequency penalties) belong to
the executor (`executor.*`), not the policy: they must act identically on the inline and the CPU
sampling paths, whichever policy runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.policy import RuntimeFeatures, register_policy
from policies.sarathi import SarathiParams, SarathiPolicy


@dataclass(frozen=True)
class SiPipeParams(SarathiParams):
    max_num_seqs: int = 512  # SiPipe's batch size (8 x H100 experiments); the rest is Sarathi's


@register_policy("sipipe")
class SiPipePolicy(SarathiPolicy):
    Params = SiPipeParams
    runtime = RuntimeFeatures(cpu_sampling=True, overlap_input_prep=True, structure_aware_transfer=True)

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"token_budget": trial.suggest_categorical("token_budget", [512, 1024, 2048, 4096]),
                "max_num_seqs": trial.suggest_categorical("max_num_seqs", [128, 256, 512, 1024])}
