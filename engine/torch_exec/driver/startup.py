"""The driver's start of a run (executor.py `TorchExecutor` mixes it in): host checks, the model and
its layer split, the control socket, the stage processes (spawned, or waited for when started by
hand), their `StageInit`, the KV pool measured on CUDA, and the stages' clock offsets."""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

import engine.torch_exec.wire.messages as wire
from engine.torch_exec.driver.control import ControlSocket
from engine.torch_exec.driver.stage_processes import start_stage
from engine.torch_exec.wire.addresses import check_host, free_port, warn_exposed
from engine.torch_exec.wire.lane import Lane
from engine.torch_exec.wire.tables import LaunchRows


class StageStartup:
    """`_start_workers` and its steps; they read the executor's settings, run config, KV manager and
    sockets, and use its `_send`, `_poll` and `_fail`."""

    def _start_workers(self) -> None:
        st = self.settings  # hosts first: a typo must not wait for the model to be written
        check_host("executor.zmq_host", st.zmq_host)
        check_host("executor.master_addr", st.master_addr, bind=st.launch == "spawn")  # external: stage 0's host
        num_blocks, block_size = self._load_model()
        addr = self._bind_control()
        if self.settings.launch == "spawn":
            self._spawn_stages(addr)
        deadline = time.perf_counter() + self.settings.start_timeout_s
        hello = self._gather(wire.Hello, deadline)
        self.stage_info = [{"host": h.host, "pid": h.pid} for h in hello]
        init = self._init_message(addr, 0 if self.measure_kv else num_blocks, block_size)
        for s in range(self.pipeline_depth):
            self._send(s, init)
        if self.measure_kv:
            self._size_pool(deadline)
        for s, r in enumerate(self._gather(wire.Ready, deadline)):
            self.stage_info[s].update(load_s=r.load_s, init_s=r.init_s, runtime_s=r.runtime_s,
                                      runtime_mib=r.runtime_mib, pid=r.pid, device=r.device)
        self._lanes.on = bool(self._lanes.lanes)  # each spawned stage reads its lane from Ready on
        self._clock_offsets(deadline)
        self._t0 = time.perf_counter()
        self._last_progress = self._t0

    def _load_model(self) -> tuple[int, int]:
        """The checkpoint (a table model is written once with random weights), its layer split,
        and the KV pool's size check; returns (num_blocks, block_size)."""
        from engine.torch_exec.weights.checkpoint import (check_kv_memory, check_random_fits, model_source,
                                                  random_checkpoint, read_arch, spec_arch)

        st = self.settings
        model = self.run_config.model
        path, spec = model_source(st, model)
        # a table model: each stage builds its own weights on its GPU, or on a host that cannot
        # read this one's runs/ (launch=external: issue 24, defect 9); else a checkpoint written once
        if path is None and (st.device == "cuda" or st.launch == "external"):
            if st.launch == "spawn":  # the GPUs of external stage hosts are not visible here
                check_random_fits(spec, self.pipeline_depth, st.resolved_dtype,
                                  self.run_config.kv.gpu_memory_utilization)
            self.model_path = ""
            self.arch = arch = spec_arch(spec)
        else:
            if path is None:
                cache = st.model_cache_dir or os.path.join(self.run_config.output.dir, "models")
                path = random_checkpoint(spec, st.model_seed, cache)
            self.model_path = os.path.abspath(path)
            self.arch = arch = read_arch(path)
        self.layers = self._layer_ranges(arch.num_layers)
        num_blocks, block_size = self.kv.num_blocks, self.kv.block_size
        check_kv_memory(self.settings, arch, num_blocks, block_size)
        seed = st.prompt_seed if st.prompt_seed is not None else self.run_config.seed
        self._rows = LaunchRows(arch.vocab_size, seed)
        return num_blocks, block_size

    def _size_pool(self, deadline: float) -> None:
        """The KV pool from the stages' measured memory (engine/torch_exec/shared/kv_sizing.py): a first
        round of probes means every stage has loaded and warmed up; the second, asked for then,
        reads a quiescent device. The controller's block manager takes the size before any block
        is handed out."""
        from engine.base.settings import MAX_KV_BLOCKS
        from engine.torch_exec.shared.kv_sizing import StageMemory, pool_size

        self._gather(wire.KvProbe, deadline)
        for s in range(self.pipeline_depth):
            self._send(s, wire.KvPool(0))
        probes = [StageMemory(**dataclasses.asdict(p)) for p in self._gather(wire.KvProbe, deadline)]
        size = pool_size(probes, self.run_config.kv.gpu_memory_utilization, MAX_KV_BLOCKS)
        self.kv.resize(size.num_blocks)
        self.kv_pool = size
        for s in range(self.pipeline_depth):
            self._send(s, wire.KvPool(size.num_blocks))

    def _bind_control(self) -> str:
        import zmq

        st = self.settings
        self._ctl = ControlSocket(self._codec, st.zmq_host, st.zmq_port)
        self._sock = self._ctl.sock
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        return self._ctl.address

    def _spawn_stages(self, addr: str) -> None:
        import zmq

        for s in range(self.pipeline_depth):
            # the secret travels as a start argument (the pipe to the child), never over a socket;
            # so does the child's end of its lane
            lane, child_end = Lane.pair()
            try:
                p = start_stage(self.settings.start_method, addr, s, self._secret, self._run_id, child_end)
            finally:
                child_end.close()
            self._procs.append(p)
            self._lanes.add(s, lane)
            self._poller.register(p.sentinel, zmq.POLLIN)
            self._poller.register(lane, zmq.POLLIN)

    def _backend(self) -> str:
        st = self.settings
        if st.device != "cuda":
            return st.backend if st.backend != "auto" else "gloo"
        from engine.torch_exec.shared.placement import data_backend

        return data_backend(st.backend, st.device, self.pipeline_depth, self._device_count(), st.launch)

    @staticmethod
    def _device_count() -> int:
        import torch

        return torch.cuda.device_count()

    def _init_message(self, addr: str, num_blocks: int, block_size: int) -> wire.StageInit:
        from engine.torch_exec.shared.kv_sizing import profile_tokens

        st, rt = self.settings, self.runtime
        master_port = st.master_port or free_port(st.master_addr)
        warn_exposed(f"stage 0's torch.distributed store (executor.master_addr, port {master_port})",
                     st.master_addr, master_port)
        sampling = wire.SamplerConfig(st.sampling, st.temperature, st.top_k, st.top_p, st.sample_seed,
                                      st.repetition_penalty, st.presence_penalty, st.frequency_penalty)
        policy_class, policy_params = self._policy_spec()
        return wire.StageInit(
            pp=self.pipeline_depth, path=self.model_path, arch=self.arch.to_dict(), layers=self.layers,
            num_blocks=num_blocks, block_size=block_size, dtype=st.resolved_dtype, device=st.device,
            threads=st.threads_per_stage, backend=self._backend(), master_addr=st.master_addr,
            master_port=master_port, stage_timeout_s=st.stage_timeout_s, fault=st.fault, sampling=sampling,
            num_cpu_samplers=st.num_cpu_samplers, cpu_sampling=rt.cpu_sampling,
            overlap_input_prep=rt.overlap_input_prep, structure_aware_transfer=rt.structure_aware_transfer,
            link_bandwidth_Bps=self.link_bandwidth_Bps, link_latency_s=self.link_latency_s,
            link_chunk_bytes=st.link_chunk_bytes, driver_addr=addr, policy_class=policy_class,
            policy_params=policy_params, model_seed=st.model_seed,
            profile_tokens=profile_tokens(st.profile_tokens, getattr(self.policy, "params", None)),
            attention=st.attention, cuda_graphs=st.cuda_graphs,
            socket_ifname=st.socket_ifname or "")

    def _layer_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        from engine.pricing.layer_balance import split_layers

        split = split_layers(num_layers, self.pipeline_depth, self.layer_split)
        out, first = [], 0
        for n in split:
            out.append((first, n))
            first += n
        return out

    def _gather(self, kind: type, deadline: float) -> list:
        got: dict[int, Any] = {}
        while len(got) < self.pipeline_depth:
            left = deadline - time.perf_counter()
            if left <= 0:
                missing = [s for s in range(self.pipeline_depth) if s not in got]
                self._fail(f"stage(s) {missing} did not report {kind._wire_tag!r} within "
                           f"executor.start_timeout_s={self.settings.start_timeout_s:g} s")
            for msg in self._poll(left, expect=kind):
                if 0 <= msg.stage < self.pipeline_depth:
                    got[msg.stage] = msg
        return [got[s] for s in range(self.pipeline_depth)]

    def _clock_offsets(self, deadline: float) -> None:
        """Stage clock - driver clock: 0 on this host (CLOCK_MONOTONIC), else from ping round trips."""
        here = socket.gethostname()
        for s, info in enumerate(self.stage_info):
            if info["host"] == here and os.uname().sysname == "Linux":
                continue
            best = None
            for _ in range(5):
                a = time.perf_counter()
                self._send(s, wire.Ping())
                msg = self._poll_one(wire.Pong, deadline)
                b = time.perf_counter()
                if best is None or b - a < best[0]:
                    best = (b - a, msg.clock - (a + b) / 2)
            self._offsets[s] = best[1]

    def _poll_one(self, kind: type, deadline: float):
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                self._fail(f"no {kind._wire_tag!r} within executor.start_timeout_s")
            msgs = self._poll(left, expect=kind)
            if msgs:
                return msgs[0]
