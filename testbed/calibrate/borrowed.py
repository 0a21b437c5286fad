"""Attention terms carried from the device whose tables measured them to a device without its own.

Only A100 has attention tables among the table-less defaults' kin (A40's tables have GEMMs and
elementwise ops, L20, RTX 4090 and A100-40GB none), so their attention is A100's fit. Two of A100's
terms are not device-neutral:
- `decode_half_blocks` is a count of (sequence, KV head) blocks at which half of A100's 108 SMs sit
  idle; on a GPU with other SMs the same fill is reached at proportionally more or fewer blocks, so
  the count scales with the SM count (the split-KV boundary and split count already use the
  device's own SM count: `decode_blocks.splits`).
- The decode read rate, 0.977 of A100's HBM peak, is the fastest a measured A100 decode row reached.
  Carried to another memory system it had GDDR6 devices (A40, L20, RTX 4090) stream KV at 0.92-0.93
  of their peak. The fastest large (>= 200 MB, far beyond any L2) weight stream measured on a
  device's own GEMM tables is the best measured DRAM rate there is for it: A40 0.844, A100 0.817
  (2026-11-27, Vidur @7d47513). A borrowed read rate is capped at the device's own figure, or
  A100's where the device has no tables at all.
A device with A100's SM count and peak bandwidth (A800) borrows the fit unchanged: there nothing is
carried across a difference.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from engine.pricing.kernels import KernelCoefficients, LayerShape
from engine.pricing.profile_table import ProfileTable

__all__ = ["weight_stream_cap", "borrow_attention", "STREAM_MIN_BYTES", "STREAM_MAX_TOKENS"]

# A stream counts when its weights dwarf every L2 of these GPUs (A100 40 MB, A40 6 MB) and the GEMM
# has so few tokens that it only streams.
STREAM_MIN_BYTES = 200e6
STREAM_MAX_TOKENS = 8


def weight_stream_cap(compute: Iterable[ProfileTable], mem_bw_Bps: float, shape_of) -> float | None:
    """The fastest fraction of peak bandwidth a weight-streaming GEMM row reached (weights plus
    activations / time): `shape_of(meta, tp)` gives a table's `LayerShape`. None without such rows."""
    best = None
    for table in compute:
        for r in table.rows:
            if not r.op.startswith("gemm") or r.tokens > STREAM_MAX_TOKENS:
                continue
            shape: LayerShape = shape_of(table.meta, r.tp)
            k, n = shape.gemm_dims()[r.op]
            nbytes = (k * n + r.tokens * (k + n)) * shape.dtype_bytes
            if nbytes >= STREAM_MIN_BYTES:
                frac = nbytes / r.time_s / mem_bw_Bps
                best = frac if best is None else max(best, frac)
    return best


def borrow_attention(c: KernelCoefficients, from_sms: int, to_sms: int, same_memory: bool,
                     stream_cap: float | None) -> tuple[KernelCoefficients, list[str]]:
    """`c`'s attention terms for a device with `to_sms` SMs, fitted on one with `from_sms`; the
    decode read rate capped at `stream_cap` unless the memory system is the same. Returns the
    coefficients and what was changed, for the profile's notes."""
    notes = []
    if to_sms != from_sms and c.decode_half_blocks:
        c = replace(c, decode_half_blocks=c.decode_half_blocks * to_sms / from_sms)
        notes.append(f"decode few-blocks term scaled by SM count ({to_sms} / {from_sms})")
    if not same_memory and stream_cap is not None:
        capped = tuple((g, min(e, stream_cap)) for g, e in c.decode_kv_efficiency)
        if capped != c.decode_kv_efficiency:
            c = replace(c, decode_kv_efficiency=capped)
            notes.append(f"decode KV read capped at {stream_cap:.3f} of peak bandwidth (the fastest large weight "
                         "stream measured on GEMM tables; the borrowed attention fit read faster)")
    return c, notes
