"""Where each stage runs and how its activations move (docs/real-engine.md, "The data plane"):
computed by the driver (which backend, refusing NCCL on shared GPUs before any stage starts) and by
each stage (its device). Torch-free."""
from __future__ import annotations


def stage_device(stage: int, device_count: int) -> str:
    """Stage s runs on cuda:(s mod visible GPUs): with P visible GPUs every stage has its own, with
    fewer the stages wrap around and share (e.g. P=4 on 2 GPUs: cuda:0, cuda:1, cuda:0, cuda:1)."""
    if device_count < 1:
        raise ValueError("no CUDA device visible")
    return f"cuda:{stage % device_count}"


def shares_a_gpu(pp: int, device_count: int) -> bool:
    return device_count < pp


def data_backend(requested: str, device: str, pp: int, device_count: int, launch: str = "spawn") -> str:
    """The torch.distributed backend of the stages' point-to-point sends.

    auto: gloo on CPU; NCCL on CUDA when each stage has its own GPU (spawned on this machine with
    at least P visible GPUs, or external stages, one per host); gloo through host memory when
    stages share a GPU, because NCCL refuses two ranks on one device. An explicit nccl with
    spawned stages sharing a GPU is refused here rather than failing inside NCCL."""
    from engine.base.errors import ConfigError

    shared = device == "cuda" and launch == "spawn" and shares_a_gpu(pp, device_count)
    if requested == "nccl" and shared:
        raise ConfigError(f"invalid executor.backend=nccl: {pp} stages share {device_count} GPU(s) and NCCL "
                          f"needs one GPU per stage; valid choices: auto, gloo")
    if requested != "auto":
        return requested
    return "nccl" if device == "cuda" and not shared else "gloo"
