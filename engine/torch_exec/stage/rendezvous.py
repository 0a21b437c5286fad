"""The stages' torch.distributed process group, listening on loopback unless told otherwise.

`init_process_group(init_method="tcp://...")` makes stage 0 host a TCPStore that listens on every
interface (`*:<port>`, whatever the address in the URL). Instead stage 0 binds the store's socket
itself on `executor.master_addr` (127.0.0.1 by default) and hands it to the store
(`TCPStore(master_listen_fd=...)`); the other stages connect to it. On loopback, gloo's and
NCCL's own sockets are pinned to the loopback interface too (GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME=lo, unless the user set them), otherwise to `executor.socket_ifname` when
given (the variables set on a stage host still win: interface names differ between hosts), else
they bind the address the host name resolves to.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys

from engine.torch_exec.wire.addresses import is_loopback, warn_exposed


def store_socket(host: str, port: int) -> socket.socket:
    """A listening socket for stage 0's store on exactly `host` ("0.0.0.0" / "::" = every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    sock.set_inheritable(True)
    return sock


def group_timeout_s(stage_timeout_s: float) -> float:
    """Bound of a single send/recv between stages. Longer than the driver's hang check
    (stage_timeout_s, which names the stuck stage and ends every stage), so that check speaks
    first; and at least 10 minutes, because a link receiver legitimately waits for as long as the
    pipeline is idle or a paced link is slow (10 kbps: 80 s for a 100 KB activation)."""
    return max(600.0, 2 * stage_timeout_s + 5)


def socket_ifnames(configured: str, master_addr: str, env) -> dict[str, str]:
    """The GLOO_/NCCL_SOCKET_IFNAME values to set: none already set on this host (interface names
    differ between hosts, so the host's own choice wins), else `executor.socket_ifname`, else
    "lo" when the rendezvous is on loopback (Linux), else none (gloo and NCCL pick)."""
    name = configured or ("lo" if is_loopback(master_addr) and sys.platform.startswith("linux") else "")
    return {key: name for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name and key not in env}


def join_group(init, stage: int):
    """Join the P-stage group of `init` (a wire.StageInit); returns (torch.distributed, the store's
    listening socket on stage 0 -- keep it alive -- or None)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=group_timeout_s(init.stage_timeout_s))
    os.environ.update(socket_ifnames(init.socket_ifname, init.master_addr, os.environ))
    listen = None
    if stage == 0:
        listen = store_socket(init.master_addr, init.master_port)
        warn_exposed(f"stage 0's torch.distributed store (executor.master_addr, port {init.master_port})",
                     init.master_addr, init.master_port)
    store = dist.TCPStore(init.master_addr, init.master_port, init.pp, stage == 0, timeout,
                          master_listen_fd=listen.fileno() if listen is not None else None)
    dist.init_process_group(init.backend, store=store, rank=stage, world_size=init.pp, timeout=timeout)
    return dist, listen
