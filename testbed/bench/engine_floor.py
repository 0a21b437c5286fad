"""The floor of `testbed bench engine`: what the model's arithmetic costs on this device, with no
engine around it -- measured in the bench's own process, in the same run as the engine.

- Linear floor: every layer's matmuls (fused q/k/v, o, fused gate/up, down) and the lm_head on
  the sampled rows, on random weights of the model's shapes in the run's dtype. On CUDA the whole
  sequence is captured in one CUDA graph per shape and replayed (no launch overhead at all); on
  CPU it runs eagerly.
- Attention floor: `scaled_dot_product_attention` per layer on contiguous K/V (no paging, no
  gather): decodes as [B, heads, 1, d] queries against [B, kv_heads, context, d]; a prefill as one
  causal [T x T] chunk. One layer's K/V tensors serve every layer (a 7B-shape batch of 256 x 2,048
  would need 30 GB per copy), so small shapes may read them from cache: a lower bound.
- Timing: CUDA events around the replays, synchronised before and after, on CUDA; `perf_counter`
  on CPU; the median of `repeats` after a warm-up.

`copy_rate` is the device's copy bandwidth (bytes read + written by one large `copy_`) and
`attention_bandwidth` times the paged-attention kernel (engine/torch_exec/kernels/paged_attention.py,
imported lazily: it may not exist in this checkout) on a paged layout, dividing the K/V bytes it
reads by its time.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn()`: CUDA events on CUDA (synchronised around), perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    out = []
    cuda = device.type == "cuda"
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(out)


@dataclass(frozen=True)
class FloorTime:
    linear_s: float
    attention_s: float


class Floor:
    """Random weights of `arch`'s shapes on `device` and the floor timings of batch shapes."""

    def __init__(self, arch, dtype: str, device: str, repeats: int = 5) -> None:
        self.arch = arch
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.repeats = repeats
        a = arch
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        g = torch.Generator(device=self.device)
        g.manual_seed(0)

        def w(*shape):
            return torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0, 0.02, generator=g)

        self.layers = [(w(q + 2 * kv, a.hidden_size), w(a.hidden_size, q), w(2 * a.intermediate_size, a.hidden_size),
                        w(a.hidden_size, a.intermediate_size)) for _ in range(a.num_layers)]
        self.lm_head = w(a.vocab_size, a.hidden_size)

    def close(self) -> None:
        """Release the weights (on CUDA: before the engine's stages measure free memory)."""
        self.layers, self.lm_head = [], None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- linear layers ------------------------------------------------------------------------
    def _linears(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        inter = self.arch.intermediate_size
        q = self.arch.num_heads * self.arch.head_dim
        for wqkv, wo, wgu, wd in self.layers:
            qkv = F.linear(x, wqkv)
            x = F.linear(qkv[:, :q], wo)
            gu = F.linear(x, wgu)
            x = F.linear(gu[:, :inter] * gu[:, inter:], wd)
        return F.linear(x[-rows:], self.lm_head)

    @torch.inference_mode()
    def linear_s(self, tokens: int, rows: int) -> float:
        x = torch.randn(tokens, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        if self.device.type != "cuda":
            return timed(lambda: self._linears(x, rows), self.device, self.repeats)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up off the capture, as torch.cuda.graphs advises
            self._linears(x, rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._linears(x, rows)
        t = timed(graph.replay, self.device, self.repeats, warmup=2)
        del graph
        return t

    # --- attention -----------------------------------------------------------------------------
    @torch.inference_mode()
    def attention_s(self, kind: str, batch: int, tokens: int, context: int) -> float:
        a = self.arch
        d, L = a.head_dim, a.num_layers
        scale = d ** -0.5

        def t(*shape):
            return torch.randn(shape, dtype=self.dtype, device=self.device)

        if kind == "decode":
            q, k, v = t(batch, a.num_heads, 1, d), t(batch, a.num_kv_heads, context, d), t(batch, a.num_kv_heads, context, d)
            causal = False
        else:
            q, k, v = t(1, a.num_heads, tokens, d), t(1, a.num_kv_heads, tokens, d), t(1, a.num_kv_heads, tokens, d)
            causal = True

        def run():
            for _ in range(L):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)

        return timed(run, self.device, self.repeats)

    def time_point(self, kind: str, batch: int, tokens: int, context: int) -> FloorTime:
        n = batch if kind == "decode" else tokens
        rows = batch if kind == "decode" else 1
        return FloorTime(self.linear_s(n, rows), self.attention_s(kind, batch, tokens, context))


def copy_rate(device: str, nbytes: int) -> float:
    """Bytes per second of one large tensor copy (read + written), the device's bandwidth yardstick."""
    dev = torch.device(device)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), dev, 5)
    return 2 * src.numel() * src.element_size() / t


def attention_bandwidth(arch, dtype: str, device: str, batch: int, context: int, block_size: int,
                        repeats: int = 5) -> tuple[float, int, float] | str:
    """(kernel seconds, K/V bytes read, bytes/s) of one layer's paged attention for `batch` decodes
    at `context` with the model's heads, blocks shuffled over the pool
    (engine/torch_exec/kernels/paged_attention.py `measure_bandwidth`); or a note saying why not measured."""
    from engine.torch_exec.kernels import paged_attention as pa

    if not pa.HAVE_TRITON:
        return "triton does not import here"
    if torch.device(device).type != "cuda":
        return "the Triton kernel runs on CPU only under Triton's interpreter (not a speed)"
    got = pa.measure_bandwidth(batch, context, kv_heads=arch.num_kv_heads,
                               group=arch.num_heads // arch.num_kv_heads, head_dim=arch.head_dim,
                               block_size=block_size, dtype=DTYPES[dtype], device=device, iters=repeats)
    return got["seconds"], int(got["bytes"]), got["bytes"] / got["seconds"]
