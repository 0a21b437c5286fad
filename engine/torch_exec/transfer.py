"""Emulated slow links on loopback: paced, chunked activation sends and their reassembly.

A send of n bytes over a link of bandwidth B and latency L takes L + n / B: the sender waits L
once, then sends the tensor's bytes in chunks of at most `chunk_bytes`, sleeping chunk / B
before each. The receiver posts one receive per chunk straight into the pre-allocated tensor's
byte view, so the chunks reassemble bit-exactly before the stage computes.
"""
from __future__ import annotations

import time

import torch


def byte_chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(a, min(nbytes, a + chunk_bytes)) for a in range(0, nbytes, chunk_bytes)] or [(0, 0)]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def split(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    flat = flat_bytes(t)
    return [flat[a:b] for a, b in byte_chunks(flat.numel(), chunk_bytes)]


def reassemble(chunks: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    flat = flat_bytes(out)
    pos = 0
    for c in chunks:
        flat[pos:pos + c.numel()].copy_(c)
        pos += c.numel()
    if pos != flat.numel():
        raise ValueError(f"chunks carry {pos} bytes, the tensor has {flat.numel()}")
    return out


def send_chunked_paced(dist, t: torch.Tensor, dst: int, chunk_bytes: int, bandwidth_Bps: float | None,
                       latency_s: float) -> None:
    if latency_s:
        time.sleep(latency_s)
    for c in split(t, chunk_bytes):
        if bandwidth_Bps:
            time.sleep(c.numel() / bandwidth_Bps)
        dist.send(c, dst=dst)


def recv_chunked(dist, out: torch.Tensor, src: int, chunk_bytes: int) -> torch.Tensor:
    for c in split(out, chunk_bytes):  # views into `out`: received in place
        dist.recv(c, src=src)
    return out
