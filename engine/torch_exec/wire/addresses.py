"""Where the engine's sockets listen: host checks before any stage starts, free ports, and the one
warning for a socket moved off loopback. Used by the driver (its control socket) and by stage 0
(the torch.distributed store it hosts, engine/torch_exec/stage/rendezvous.py)."""
from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_host(key: str, host: str, bind: bool = True) -> None:
    """A host setting that cannot work is a one-line error naming it before any stage starts:
    a name that does not resolve, an address not on this machine (`bind`), or an IPv6 address
    (the control plane speaks IPv4)."""
    from engine.base.errors import bad_value

    valid = "use 127.0.0.1 (this machine), 0.0.0.0 (every interface) or an IPv4 address of this machine"
    if ":" in host:
        raise bad_value(key, host, f"IPv6 addresses are not supported; {valid}")
    try:
        socket.getaddrinfo(host, 0, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise bad_value(key, host, f"cannot be resolved ({exc.strerror}); {valid}") from None
    if not bind:
        return
    try:
        free_port(host)
    except OSError as exc:
        raise bad_value(key, host, f"cannot be bound here ({exc.strerror or exc}); {valid}") from None


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def warn_exposed(what: str, host: str, port: int | str) -> None:
    """The one warning for a listening socket the user moved off loopback."""
    if not is_loopback(host):
        log.warning("%s listens on %s:%s, not loopback: reachable from other machines "
                    "(messages still need the run's secret)", what, host, port)
