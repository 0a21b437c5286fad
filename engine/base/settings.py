"""The run config's top-level sections as frozen dataclasses: what the runner and executors read.

`testbed/config/composer.py` composes the user's `key=value` overrides with Hydra and turns the result
into a `RunConfig` (`testbed.config.composer.run_config`), checked field by field by engine/base/typed.py, so
executors receive typed settings and never re-read the raw dict. Torch-free and cheap: every
simulated run builds these.

Links: `link.bandwidth` / `link.latency` unset (null) mean "the hardware's own stage-to-stage
link" in both executors. The runner resolves the section once (`LinkSettings.resolve`) to a
`Link` with the hardware profile's `p2p_bw_gbs` / `p2p_latency_s` filling whatever is unset;
the simulator models that link, and the torch engine, which runs on real hardware, uses the real
link as it is. Setting either key (`Link.explicit`) names an emulated link: the simulator models
it and the torch engine paces its loopback data plane to it (the unset half again taken from the
hardware profile).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.base.errors import bad_value
from engine.base.typed import check, setting
from engine.base.units import parse_bandwidth, parse_duration

MAX_KV_BLOCKS = 1 << 24  # the block manager keeps a Python free list: 16.7M blocks is ~0.6 GB of it


@dataclass(frozen=True)
class SLO:
    """The `slo` section: the limits `summary.json`'s `slo_attainment` judges by (engine/core/metrics.py).
    Here with the other sections, below the executor and the controller that read them: the
    metrics, which import the controller, import it from here (and still export it)."""

    ttft_s: float = 4.0  # gLLM's Azure SLO
    tpot_s: float = 0.2

    def __post_init__(self) -> None:
        for key in ("ttft_s", "tpot_s"):
            value = getattr(self, key)
            if not value > 0:
                raise bad_value(f"slo.{key}", value, "must be > 0 seconds")


@dataclass(frozen=True)
class ParallelSettings:
    """`parallel.*`: pipeline depth P, tensor-parallel degree, layers per stage."""

    pp: int = setting(4, min=1)  # upper bound: the model's layer count (checked by the cost model)
    tp: int = setting(1, min=1)
    # layers per stage; None = as even as possible; "balanced": stage time and KV memory balanced
    # counting the embedding, LM head and sampler (engine/pricing/layer_balance.py)
    layer_split: tuple[int, ...] | Literal["balanced"] | None = None
    num_microbatches: int | None = setting(None, min=1)  # micro-batches in flight, 1..2P; None = the policy's choice

    def __post_init__(self) -> None:
        check(self, "parallel")
        if self.layer_split is not None and len(self.layer_split) == 0:  # [] silently meant an even split
            raise bad_value("parallel.layer_split", "[]", "must list the layers of each of the pp stages, or be "
                                                          "null (as even as possible)")
        n = self.num_microbatches
        if n is not None and n > 2 * self.pp:
            raise bad_value("parallel.num_microbatches", n,
                            f"must be in [1, 2*pp] = [1, {2 * self.pp}] or null (the policy's choice)")


@dataclass(frozen=True)
class KVSettings:
    """`kv.*`: the paged KV cache (one block manager for the whole pipeline)."""

    block_size: int = setting(16, min=1)  # tokens per block
    gpu_memory_utilization: float = setting(0.9, gt=0, max=1)  # share of GPU memory for weights + KV
    num_blocks: int | None = setting(None, min=1, max=MAX_KV_BLOCKS)  # None = derived from memory

    def __post_init__(self) -> None:
        check(self, "kv")


MAX_LINK_LATENCY_S = 3600.0
# ideal: a FIFO pipe (latency + bytes / bandwidth + the cost model's metadata term); tcp: TCP over a
# delayed, rate-limited link as gloo uses it (round trips per message, slow start, restart after
# idle), constants measured through a real kernel link (engine/pricing/tcp_link.py, docs/links.md)
LINK_MODELS = ("ideal", "tcp")


@dataclass(frozen=True)
class Link:
    """A resolved stage-to-stage link: both numbers known, and whether the run named it."""

    bandwidth_Bps: float
    latency_s: float
    explicit: bool = False  # True: set by link.* (the torch engine paces to it); False: the hardware's own
    model: str = "ideal"  # how the simulator prices a transfer: LINK_MODELS


@dataclass(frozen=True)
class LinkSettings:
    """`link.*`: null = the hardware's link (see the module docstring). Values with units are parsed
    by engine/base/units.py: `bandwidth` to bytes/s ("1Gbps", "20.8GB/s"), `latency` to seconds ("30us")."""

    # at least 1 kB/s: slower, one activation transfer takes longer than any run (1e-300 gave inf)
    bandwidth: float | None = setting(None, parse=parse_bandwidth, min=1e3)
    # at most an hour: beyond that simulated times lose their precision (1e308 s gave inf and NaN)
    latency: float | None = setting(None, parse=parse_duration, max=MAX_LINK_LATENCY_S)
    model: str = setting("ideal", choices=LINK_MODELS)  # the simulator's pricing; the torch engine runs real sends

    def __post_init__(self) -> None:
        check(self, "link")

    @property
    def explicit(self) -> bool:
        return self.bandwidth is not None or self.latency is not None

    def resolve(self, hardware: Any) -> Link:
        """Fill what is unset from the hardware profile (`p2p_bw_gbs` in GB/s, `p2p_latency_s`)."""
        bw = self.bandwidth if self.bandwidth is not None else hardware.p2p_bw_gbs * 1e9
        lat = self.latency if self.latency is not None else hardware.p2p_latency_s
        return Link(bw, lat, self.explicit, self.model)


@dataclass(frozen=True)
class RuntimeSettings:
    """`runtime.*`: switch SiPipe's runtime techniques on or off for any policy; null keeps the
    policy's own choice (`engine.core.policy.RuntimeFeatures`)."""

    cpu_sampling: bool | None = None
    overlap_input_prep: bool | None = None
    structure_aware_transfer: bool | None = None

    def __post_init__(self) -> None:
        check(self, "runtime")


@dataclass(frozen=True)
class OutputSettings:
    """`output.*`: where a run is written and tracked (read by the CLI; the torch engine caches
    random checkpoints under `dir`)."""

    dir: str = "runs"
    run_name: str | None = None  # None = <time>_<policy>_<workload>
    mlflow: bool = True
    tracking_uri: str | None = None  # None = sqlite:///<dir>/mlflow.db
    experiment: str = "testbed"
    max_trace_spans: int = setting(200_000, min=0)
    trace: str = setting("sampled", choices=("sampled", "full", "off"))  # what trace.json keeps (simulator)
    requests: bool = True  # requests.csv (the per-request table)
    # microbatches.csv (one row per micro-batch): None = for the real engine only, whose runs
    # `calibrate runs` and `validate --runs` read; the main job's simulated one is 5.2 MB of its 6.8
    microbatches: bool | None = None
    plots: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        check(self, "output")
        if not str(self.experiment).strip():  # `output.experiment=` silently landed in "testbed"
            raise bad_value("output.experiment", self.experiment, "must name an MLflow experiment (default: testbed)")


@dataclass(frozen=True)
class ExecutorChoice:
    """`executor=<name>` and its settings dataclass (`SimSettings`, `TorchSettings`, ...)."""

    name: str = "sim"
    settings: Any = None


@dataclass(frozen=True)
class RunConfig:
    """The typed top-level run config (the `policy`, `workload` and `cost` groups are typed by their
    own dataclasses, built by their registries). `seed` is the root of every random stream that is
    not pinned separately: see testbed/config/composer.py."""

    seed: int = setting(0, min=0)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    kv: KVSettings = field(default_factory=KVSettings)
    link: LinkSettings = field(default_factory=LinkSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    slo: SLO = field(default_factory=SLO)
    output: OutputSettings = field(default_factory=OutputSettings)
    executor: ExecutorChoice = field(default_factory=ExecutorChoice)
    data_dir: str | None = None  # None: $TESTBED_DATA_DIR, then the cache (workloads/data.py)
    check_integrity: bool = False  # the controller re-checks KV and sequence invariants every step
    model: Any = None  # engine.pricing.models.ModelSpec of the run
    hardware: Any = None  # engine.pricing.hardware.HardwareSpec of the run

    def __post_init__(self) -> None:
        check(self, "")  # top-level keys: seed, data_dir, check_integrity


SECTIONS: dict[str, type] = {"parallel": ParallelSettings, "kv": KVSettings, "link": LinkSettings,
                             "runtime": RuntimeSettings, "slo": SLO, "output": OutputSettings}

__all__ = ["ParallelSettings", "KVSettings", "Link", "LinkSettings", "RuntimeSettings", "OutputSettings",
           "ExecutorChoice", "RunConfig", "SECTIONS", "MAX_KV_BLOCKS"]
