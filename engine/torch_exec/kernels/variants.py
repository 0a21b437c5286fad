"""How many variants of the engine's Triton kernels this process has compiled.

A run must compile none: every variant it can need is compiled at start-up (piecewise graphs'
capture and `warm_attention`), since a compile mid-run is a 0.5-1 s stall on an H100
(docs/calibrate-runs.md). Triton keeps its compiled kernels per device in `JITFunction.device_caches`
(Triton 3.x: `(kernel_cache, kernel_key_cache, target, backend, binder)`), one entry per
specialisation key; their sizes before and after a run are the check (tests/test_engine_gpu.py).
"""
from __future__ import annotations

KERNELS = (("engine.torch_exec.kernels.paged_attention", ("_paged_attn_kernel", "_write_kv_kernel")),
           ("engine.torch_exec.kernels.fused", ("_add_rms_norm_kernel", "_rope_write_kv_kernel", "_silu_mul_kernel")))


def compiled_variants() -> dict[str, int]:
    """Kernel name -> variants compiled in this process (all devices); {} without Triton."""
    import importlib

    out: dict[str, int] = {}
    for module, names in KERNELS:
        mod = importlib.import_module(module)
        if not getattr(mod, "HAVE_TRITON", False):
            return {}
        for name in names:
            caches = getattr(getattr(mod, name), "device_caches", {})
            out[name] = sum(len(c[0]) for c in caches.values())
    return out
