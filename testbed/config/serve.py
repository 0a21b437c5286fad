"""The `serve.*` config section (merged into the run config by testbed/config/composer.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.base.errors import bad_value

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeSettings:
    """How `testbed serve` listens and paces.

    `max_queue` bounds the requests the server holds at once (waiting + running): one more is
    answered 429. `time_scale` paces `executor=sim` (simulated seconds per wall second: 1.0 is
    real time, 10 runs the simulated cluster ten times faster). `drain_timeout_s`: on SIGTERM or
    Ctrl-C, requests in flight get this long to finish before they are aborted.

    What one client may cost (testbed/serve/limits.py): a body over `max_body_bytes` is answered
    413 before it is read whole; a request whose headers are not complete `header_timeout_s` after
    its first byte has its connection closed; a body not complete `body_timeout_s` after it began
    is answered 408; an address may hold `max_connections_per_client` connections at once (one
    more is answered 429 and closed); an idle keep-alive connection is closed after `keep_alive_s`.
    """

    host: str = "127.0.0.1"  # loopback unless the user names another address
    port: int = 8000  # 0 = pick a free port (printed at start-up)
    model_name: str | None = None  # the model id clients see; None = the run's model name
    max_queue: int = 256
    time_scale: float = 1.0
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as OpenAI's)
    poll_interval_s: float = 0.005  # executor=torch: how often the engine thread looks for new arrivals
    drain_timeout_s: float = 30.0
    log_level: str = "warning"  # uvicorn's
    max_body_bytes: int = 8 * 1024 * 1024  # 8 MiB: a 128K-token prompt as ids is about 1 MB of JSON
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections_per_client: int = 512  # twice max_queue: a benchmark from one host may hold max_queue requests
    warmup_requests: int = 4  # executor=torch: served and forgotten before the server listens (0 = none)

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise bad_value("serve.port", self.port, "must be a port number (0 = pick a free one)")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise bad_value("serve.max_queue", self.max_queue, "must be an integer >= 1")
        if isinstance(self.warmup_requests, bool) or not isinstance(self.warmup_requests, int) \
                or self.warmup_requests < 0:
            raise bad_value("serve.warmup_requests", self.warmup_requests, "must be an integer >= 0 (0 = no warm-up)")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < 1024:
            raise bad_value("serve.max_body_bytes", self.max_body_bytes, "must be an integer >= 1024")
        if isinstance(self.max_connections_per_client, bool) or not isinstance(self.max_connections_per_client, int) \
                or self.max_connections_per_client < 1:
            raise bad_value("serve.max_connections_per_client", self.max_connections_per_client,
                            "must be an integer >= 1")
        if isinstance(self.default_max_tokens, bool) or not isinstance(self.default_max_tokens, int) \
                or self.default_max_tokens < 1:
            raise bad_value("serve.default_max_tokens", self.default_max_tokens, "must be an integer >= 1")
        for key in ("time_scale", "poll_interval_s", "drain_timeout_s", "header_timeout_s", "body_timeout_s",
                    "keep_alive_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise bad_value(f"serve.{key}", value, "must be a number > 0")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise bad_value("serve.log_level", self.log_level,
                            "must be one of critical, error, warning, info, debug, trace")

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK


def serve_defaults() -> dict:
    """The section's defaults as a plain dict (what testbed/config/composer.py merges into BASE)."""
    return dataclasses.asdict(ServeSettings())
