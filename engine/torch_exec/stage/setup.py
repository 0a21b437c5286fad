"""A stage's set-up from the driver's `StageInit` (worker.py `_Stage` mixes it in): device, fault
injection, its model slice and weights, the KV pool (given, or measured by a profile run and agreed
with the driver), the runtime features the policy asked for, and the last stage's sampler."""
from __future__ import annotations

import os
import socket
import time
from collections import deque

import engine.torch_exec.wire.messages as wire


class StageSetup:
    """Everything `setup` builds on the stage; it reads the stage's `stage`, `codec`, `secret`, `send`,
    `recv`, `line` and `setup_links` (linked.py)."""

    def setup(self, init: wire.StageInit) -> None:
        t0 = time.perf_counter()
        import torch

        self.torch = torch
        self.init = init
        self.P = init.pp
        self.first = self.stage == 0
        self.last = self.stage == self.P - 1
        self.setup_device(init)
        self.setup_fault(init.fault)
        self.load_model(init)
        if init.num_blocks == 0:
            self.size_kv(init)
        t_load = time.perf_counter() - t0
        if self.P > 1:
            from engine.torch_exec.stage.rendezvous import join_group

            self.dist, self._store_socket = join_group(init, self.stage)
        t_runtime, reserved = time.perf_counter(), self.reserved_mib()
        self.setup_runtime(init)
        runtime_s, runtime_mib = time.perf_counter() - t_runtime, self.reserved_mib() - reserved
        if self.P > 1 and (self.bw or self.lat):
            self.setup_links(init)
        if self.last:
            self.setup_sampling(init)
        self.send(wire.Ready(self.stage, os.getpid(), str(self.device), t_load, time.perf_counter() - t0,
                             runtime_s, runtime_mib))
        self.line.use_lane()  # the driver writes to the lane from Ready on

    def reserved_mib(self) -> float:
        """Device memory the caching allocator holds (CUDA graphs' pools included); 0 off CUDA."""
        torch = self.torch
        return torch.cuda.memory_reserved(self.device) / 2**20 if str(self.device).startswith("cuda") else 0.0

    def setup_device(self, init: wire.StageInit) -> None:
        torch = self.torch
        device = init.device
        if device == "cpu":
            torch.set_num_threads(init.threads)
        elif device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"executor.device=cuda, but stage {self.stage} on {socket.gethostname()} "
                                   f"sees no CUDA device")
            from engine.torch_exec.shared.placement import stage_device

            device = stage_device(self.stage, torch.cuda.device_count())
            torch.cuda.set_device(device)
        self.device = device
        self.transfer_via_cpu = init.backend == "gloo" and device != "cpu"

    def setup_fault(self, spec: str) -> None:
        if spec:
            from engine.torch_exec.settings import parse_fault

            kind, st, n = parse_fault(spec)
            if st == self.stage:
                self.fault = (kind, n)

    def load_model(self, init: wire.StageInit) -> None:
        from engine.pricing.models import ModelSpec
        from engine.torch_exec.stage.model import StageModel

        self.arch = arch = ModelSpec(**init.arch)
        first_layer, n_layers = init.layers[self.stage]
        num_blocks = init.num_blocks
        if num_blocks == 0:  # measured later: a pool just large enough for the warm-up batch
            from engine.torch_exec.shared.kv_sizing import warmup_shape

            num_blocks = warmup_shape(init.profile_tokens, init.block_size)[2]
        self.model = StageModel(arch, first_layer, n_layers, self.first, self.last, num_blocks,
                                init.block_size, init.dtype, self.device, attention=init.attention)
        if init.path:
            self.model.load(init.path)
        else:  # a table model on the GPU: this stage's random tensors, built in place
            from engine.torch_exec.weights.checkpoint import random_tensors, stage_tensor_names

            names = stage_tensor_names(arch, first_layer, n_layers, self.first, self.last)
            self.model.set_weights(random_tensors(arch, names, init.model_seed, self.model.dtype, self.device))
        self.hidden = arch.hidden_size

    def size_kv(self, init: wire.StageInit) -> None:
        """vLLM's profile run, then probes until the driver names the one pool size of all
        stages (engine/torch_exec/stage/profile_run.py, shared/kv_sizing.py)."""
        from engine.torch_exec.stage.profile_run import probe, warm_up

        peak = warm_up(self.model, init.profile_tokens, self.first)
        while True:
            self.send(probe(self.model, self.stage, peak))
            msg = self.recv(max(600.0, 5 * init.stage_timeout_s))  # the other stages may still be loading
            if not isinstance(msg, wire.KvPool):
                raise RuntimeError(f"expected kv_pool, got {msg._wire_tag!r}")
            if msg.num_blocks > 0:
                self.model.allocate_kv(msg.num_blocks)
                return

    def setup_runtime(self, init: wire.StageInit) -> None:
        self.model.configure(init.attention, init.cuda_graphs, init.profile_tokens)  # attention path; CUDA graphs
        self.overlap = init.overlap_input_prep
        # the next micro-batch, when it is known, is prepared while this one runs: by SiPipe's prep
        # thread, or on a GPU between a forward's launch and its end (the host is idle then)
        self.look_ahead = self.overlap or self.device != "cpu"
        self.prepared: dict[int, object] = {}  # mb id -> future of its prepared inputs (<= 2 buffers)
        self.ready: dict[int, object] = {}  # mb id -> its inputs, prepared on the main thread
        self.aware = init.structure_aware_transfer
        self.bw = init.link_bandwidth_Bps
        self.lat = init.link_latency_s
        self.chunk = init.link_chunk_bytes or (1 << 20)
        if self.overlap:
            from concurrent.futures import ThreadPoolExecutor

            self.prep_pool = ThreadPoolExecutor(1, thread_name_prefix="prep")
        self.fwd_start: float | None = None  # the forward running now (for the policy's T_a)
        self.fwd_kind = ""
        self.fwd_ema: dict[str, float] = {}  # kind -> mean forward time
        self.decode_starts: deque = deque(maxlen=8)  # recent decode forward starts (next decode's ETA)

    def setup_sampling(self, init: wire.StageInit) -> None:
        from engine.torch_exec.stage.sampling import Sampler

        self.sampler = Sampler(self.arch.vocab_size, **init.sampling.kwargs())
        if init.cpu_sampling:
            from engine.torch_exec.stage.cpu_sampler import SamplerPool

            self.samplers = SamplerPool(init.num_cpu_samplers, init.driver_addr, self.secret,
                                        self.arch.vocab_size, init.sampling, timeout_s=120.0,
                                        me=self.codec.me, run=self.codec.run)
