"""GPU and link tables for the cost model (the papers' setups: docs/policies.md#references).

Numbers are vendor datasheet peaks: dense fp16/bf16 tensor throughput (no structured sparsity) and
HBM/GDDR bandwidth in decimal GB/s (1e9). The cost model applies its own efficiency factors
(`CostCoefficients`), so these tables stay the published peaks and calibrated profiles are added
with `register_hardware` rather than by editing the factory entries.

Links. The default stage-to-stage link of each GPU is what the papers ran on:
- PCIe machines (TD-Pipe's 4x L20-48GB and 4x A100-80GB, "PCIe only"): point-to-point 20.8 GB/s
  and all-reduce bus bandwidth 14.7 GB/s, both measured figures of TD-Pipe's setting (ICPP'25).
  A100/A800 are kept on PCIe on purpose, because that is how TD-Pipe measured them; an NVLink
  A100 box is a different machine and should be registered under its own name.
- H100: SiPipe's 8x H100 servers are SXM boxes with NVLink 4 (450 GB/s per direction per GPU).
  We assume ~80% of that is reached by NCCL send/recv and by ring all-reduce bus bandwidth
  (360 GB/s); an assumption, not a measurement. Cross-node links (400 Gbps NICs) and MoLink's
  100 Mbps / 30 ms are per-run overrides of the link, parsed with `engine.base.units.parse_bandwidth`.
- RTX 4090: no GPU peer-to-peer (disabled by NVIDIA on GeForce), NCCL stages through host memory
  over PCIe 4.0; we keep the PCIe figures as an optimistic default. MoLink's 4090 setups override
  the link with the slow network anyway.
Latency: 10 us per NCCL hop inside a box (small-message send/recv and per ring step of an
all-reduce); an order-of-magnitude figure, calibrate it when it matters.

Memory is the marketing size read as GiB (80 GB -> 80 GiB, matching A100-80GB's 81,920 MiB);
some cards report slightly less (H100 ~79.6 GiB, L20 ~45 GiB), which `gpu_memory_utilization`
in the KV sizing absorbs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from engine.base.errors import ConfigError, unknown_choice

__all__ = ["HardwareSpec", "HARDWARE", "get_hardware", "register_hardware"]

PCIE_P2P_GBS = 20.8  # measured PCIe P2P in TD-Pipe's setting (ICPP'25)
PCIE_ALLREDUCE_GBS = 14.7  # measured PCIe all-reduce in TD-Pipe's setting (ICPP'25)
NVLINK4_GBS = 360.0  # assumption: ~80% of H100 SXM NVLink 4's 450 GB/s per direction
INTRA_BOX_LATENCY_S = 10e-6  # per NCCL hop; order of magnitude


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU kind and its default links. Bandwidths in GB/s (1e9 bytes/s), memory in GiB.

    `peak_tflops`: dense fp16/bf16 tensor peak per GPU. `p2p_bw_gbs`/`p2p_latency_s`: the default
    stage-to-stage link. `allreduce_bw_gbs`: ring all-reduce bus bandwidth for tensor parallelism.
    """

    name: str
    description: str
    peak_tflops: float
    mem_bw_gbs: float
    mem_gib: float
    p2p_bw_gbs: float
    p2p_latency_s: float
    allreduce_bw_gbs: float
    cpu_cores_hint: int | None = None
    # Fitted CostCoefficients of a calibrated profile (`testbed profile`); None for table GPUs,
    # whose coefficients are the cost model's defaults. `cost.<field>=` still overrides either.
    calibration: dict | None = None
    # Fitted operator-level kernel coefficients (engine/pricing/kernels.KernelCoefficients as a mapping):
    # when set, the cost model prices each operator with them instead of the roofline
    # (docs/calibration.md#measured-kernels). `sm_count` is the GPU's streaming multiprocessors
    # (decode attention runs in waves of them).
    kernels: dict | None = None
    sm_count: int | None = None
    # Per-hop latency of an all-reduce ring step; None = p2p_latency_s (the roofline's assumption).
    allreduce_latency_s: float | None = None
    # Which profile this is, recorded with every run (summary.json, MLflow): e.g. "roofline-1", or
    # the fitted tables' source commit and fit date.
    version: str = "roofline-1"
    # USD per GPU-hour, set by the user (`hardware.cost_per_gpu_hour=`, `capacity.price.<name>=`, or a
    # profile file); None: unknown. Only `testbed capacity` reads it (requests per dollar).
    cost_per_gpu_hour: float | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"hardware name must be a non-empty string, got {self.name!r}")
        for field_name in ("peak_tflops", "mem_bw_gbs", "mem_gib", "p2p_bw_gbs", "allreduce_bw_gbs"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise ConfigError(f"invalid hardware {self.name}.{field_name}={value!r}: must be a positive number")
        lat = self.p2p_latency_s
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not (math.isfinite(lat) and lat >= 0):
            raise ConfigError(f"invalid hardware {self.name}.p2p_latency_s={lat!r}: must be >= 0 seconds")
        if self.kernels is not None:
            from engine.pricing.kernels import KernelCoefficients

            KernelCoefficients.from_mapping(self.kernels)  # validates
        if self.sm_count is not None and (isinstance(self.sm_count, bool) or not isinstance(self.sm_count, int)
                                          or self.sm_count < 1):
            raise ConfigError(f"invalid hardware {self.name}.sm_count={self.sm_count!r}: must be a positive integer")
        if self.cpu_cores_hint is not None and (
            isinstance(self.cpu_cores_hint, bool) or not isinstance(self.cpu_cores_hint, int) or self.cpu_cores_hint < 1
        ):
            raise ConfigError(
                f"invalid hardware {self.name}.cpu_cores_hint={self.cpu_cores_hint!r}: must be a positive integer or None"
            )
        price = self.cost_per_gpu_hour
        if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float))
                                  or not (math.isfinite(price) and price > 0)):
            raise ConfigError(f"invalid hardware {self.name}.cost_per_gpu_hour={price!r}: must be a price > 0 "
                              f"(USD per GPU-hour) or null")

    # SI conveniences used by the cost model (computed once there, not per call).
    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def mem_bw_Bps(self) -> float:
        return self.mem_bw_gbs * 1e9

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * 2.0**30

    @property
    def p2p_bw_Bps(self) -> float:
        return self.p2p_bw_gbs * 1e9

    @property
    def allreduce_bw_Bps(self) -> float:
        return self.allreduce_bw_gbs * 1e9


def _pcie(name: str, description: str, tflops: float, bw: float, mem: float) -> HardwareSpec:
    return HardwareSpec(
        name=name,
        description=description,
        peak_tflops=tflops,
        mem_bw_gbs=bw,
        mem_gib=mem,
        p2p_bw_gbs=PCIE_P2P_GBS,
        p2p_latency_s=INTRA_BOX_LATENCY_S,
        allreduce_bw_gbs=PCIE_ALLREDUCE_GBS,
    )


HARDWARE: dict[str, HardwareSpec] = {}


def register_hardware(spec: HardwareSpec) -> HardwareSpec:
    """Add a (e.g. calibrated) GPU profile. A name already present is refused, never overwritten."""
    if not isinstance(spec, HardwareSpec):
        raise ConfigError(f"register_hardware expects a HardwareSpec, got {type(spec).__name__}")
    if spec.name in HARDWARE:
        raise ConfigError(
            f"duplicate hardware name {spec.name!r}: already registered ({HARDWARE[spec.name].description}); "
            "register a calibrated profile under a new name"
        )
    HARDWARE[spec.name] = spec
    return spec


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except (KeyError, TypeError):
        raise unknown_choice("hardware", name, HARDWARE) from None


SHIPPED_DIR = Path(__file__).resolve().parent / "hardware_profiles"


def register_shipped(directory: Path = SHIPPED_DIR) -> list[str]:
    """Register the fitted profiles shipped in engine/pricing/hardware_profiles/ (the defaults `a100-80g`,
    `h100-80g`, `a40-48g`, ...; written by `testbed calibrate tables --save`). Their `profile:`
    block is provenance, not a field."""
    import yaml

    names = []
    for path in sorted(directory.glob("*.yaml")):
        data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        data.pop("profile", None)
        names.append(register_hardware(HardwareSpec(**data)).name)
    return names


for _spec in (
    # A100 SXM4 80GB: 312 TFLOPS dense fp16, 2,039 GB/s HBM2e (the PCIe card: 1,935 GB/s).
    _pcie("a100-80g-roofline", "NVIDIA A100 80GB, PCIe links as in TD-Pipe; hand-set roofline", 312.0, 2039.0, 80.0),
    # A100 40GB: 312 TFLOPS, 1,555 GB/s HBM2.
    _pcie("a100-40g-roofline", "NVIDIA A100 40GB, PCIe links; hand-set roofline", 312.0, 1555.0, 40.0),
    # A800 80GB: the China-market A100 (same compute and HBM; only NVLink is capped).
    _pcie("a800-80g-roofline", "NVIDIA A800 80GB, PCIe links; hand-set roofline", 312.0, 2039.0, 80.0),
    # L20 48GB: 119.5 TFLOPS dense fp16, 864 GB/s GDDR6 (TD-Pipe's 4x L20, PCIe only).
    _pcie("l20-48g-roofline", "NVIDIA L20 48GB, PCIe links as in TD-Pipe; hand-set roofline", 119.5, 864.0, 48.0),
    # RTX 4090 24GB: ~165 TFLOPS dense fp16 with fp32 accumulate, 1,008 GB/s GDDR6X; no P2P.
    _pcie("rtx4090-roofline", "NVIDIA GeForce RTX 4090 24GB, PCIe (no P2P, staged via host); hand-set roofline",
          165.0, 1008.0, 24.0),
    # A40 48GB: 149.7 TFLOPS dense fp16 tensor, 696 GB/s GDDR6, 84 SMs (the published A40 tables).
    _pcie("a40-48g-roofline", "NVIDIA A40 48GB, PCIe links; hand-set roofline", 149.7, 696.0, 48.0),
    # H100 SXM5 80GB: 989 TFLOPS dense fp16, 3,350 GB/s HBM3; NVLink 4 inside the box (SiPipe).
    HardwareSpec(
        name="h100-80g-roofline",
        description="NVIDIA H100 SXM 80GB, NVLink 4 inside the box (SiPipe's 8x H100); hand-set roofline",
        peak_tflops=989.0,
        mem_bw_gbs=3350.0,
        mem_gib=80.0,
        p2p_bw_gbs=NVLINK4_GBS,
        p2p_latency_s=INTRA_BOX_LATENCY_S,
        allreduce_bw_gbs=NVLINK4_GBS,
    ),
):
    register_hardware(_spec)
del _spec
register_shipped()
