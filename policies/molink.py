"""MoLink: serving over slow links between stages (MoLink, 2025; docs/policies-specialised.md#molink).

Batching is vLLM V0's (separate prefill / decode micro-batches, one scheduler per "virtual
engine"), with two MoLink additions:

- Transmission scheduling per link (`schedule_transfer`, Algorithm 1): two queues, decode and
  prefill. Decode activations go first, whole; each decode sent while a prefill waits adds 1 to
  the link's waiting weight W; when W >= N (30) or no decode waits, the prefill is sent: its whole
  remainder if W >= N, else one just-in-time chunk; W resets to 0 after any prefill send. So a
  decode waits behind at most one prefill send, and a prefill behind at most N decode sends.
  Chunk bytes = T_a x bandwidth (min `min_chunk_bytes`), T_a the predicted idle time of the link
  before the next decode activation needs it: while the upstream stage runs a batch, the time
  left of that execution (T_d + t_s - t_c; T_d when it just started); when the upstream stage is
  idle, the predicted time for the next decode batch to come round the pipeline (t_f - t_c with
  t_f = t_p + T_o + T_m: sum of stage times of a decode batch plus link latencies and decode and
  token transfer times, from the cost model; the executor may pass `next_decode_s` instead).
  `chunking=false` turns Algorithm 1 off: FIFO, whole tensors (vLLM's links).
- Micro-batch extension: `max_inflight` = k in [P, 2P] micro-batches in flight (k virtual
  engines). `extension=rule`: the public code's rule, the first k >= 3 with
  (k - 2) x compute >= 2 x transmission (compute: one stage's time for a decode batch of
  `rule_batch_size` sequences at `rule_context` tokens; transmission: link latency + that batch's
  activation bytes / bandwidth), clamped to [P, 2P]. `extension=search`: before the run
  (`prepare`), short simulations of the same setup for every k in [P, 2P]; the best k replaces
  `search` in the params. An integer fixes k (clamped to [P, 2P]); `off`/false is k = P; true
  means `rule`.
- `parallel.num_microbatches`, when set, is the number of micro-batches (virtual engines) and
  wins over `extension` (which then has nothing to choose); unset, `extension` picks k.

The link's bandwidth and latency are the run's (`view.link_bandwidth_Bps` / `link_latency_s`),
or those of the `LinkState` of the first `schedule_transfer` call on a torch stage.

On the torch executor each sending stage rebuilds this policy from its class and params and
calls `schedule_transfer` from its link's sender thread whenever the link is free
(engine/torch_exec/stage/transfer.py); `LinkState.info` then carries `upstream_busy` / `upstream_end_s`
(the stage's running forward: its start plus the stage's mean forward time of that kind) and,
while idle, `next_decode_s` (last decode forward start plus the mean decode period).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.pricing.costmodel import BatchShape
from engine.base.errors import bad_value
from engine.core.policy import LinkState, PendingTransfer, PrepareContext, SchedulerView, Transfer, register_policy
from policies.vllm import VllmParams, VllmPolicy

EXTENSION_MODES = ("rule", "search", "off")


@dataclass(frozen=True)
class MoLinkParams(VllmParams):
    extension: object = "rule"  # rule | search | off | <int k> | true (= rule) | false (= off)
    N: int = 30  # waiting-weight threshold against prefill starvation
    chunking: bool = True  # Algorithm 1 (decode first, just-in-time prefill chunks); false = FIFO whole
    min_chunk_bytes: int = 256 * 1024  # smallest prefill chunk (a chunk pays a send's fixed costs)
    rule_batch_size: int = 8  # decode batch the extension rule sizes compute and transmission by
    rule_context: int = 1024
    search_requests: int = 60  # requests per simulation of extension=search
    search_metric: str = "e2el_mean_s"  # minimised by extension=search
    # MoLink's loop re-creates every finished step at once (`MolinkEngine.run_engine_loop`,
    # molink/engine/molink_engine.py, oldcpple/MoLink 087e078; an empty step sleeps 2 ms), so an
    # idle engine reads a new request within ~2 ms: placed on arrival, not at vLLM's next step
    placement: str = "arrival"

    def __post_init__(self) -> None:
        super().__post_init__()
        ext = self.extension
        if isinstance(ext, bool):
            pass
        elif isinstance(ext, int):
            if ext < 1:
                raise bad_value("policy.extension", ext, "must be rule, search, off or an integer >= 1")
        elif ext not in EXTENSION_MODES:
            raise bad_value("policy.extension", ext, "must be rule, search, off, true, false or an integer >= 1")
        if isinstance(self.N, bool) or not isinstance(self.N, int) or self.N < 1:
            raise bad_value("policy.N", self.N, "must be an integer >= 1")
        if self.min_chunk_bytes < 1:
            raise bad_value("policy.min_chunk_bytes", self.min_chunk_bytes, "must be >= 1")
        if self.rule_batch_size < 1 or self.rule_context < 1:
            raise bad_value("policy.rule_batch_size", self.rule_batch_size, "rule_batch_size and rule_context must be >= 1")
        if self.search_requests < 1:
            raise bad_value("policy.search_requests", self.search_requests, "must be >= 1")

    @property
    def extension_mode(self) -> str | int:
        ext = self.extension
        if ext is True:
            return "rule"
        if ext is False:
            return "off"
        return ext


def extension_rule(P: int, compute_s: float, transmission_s: float) -> int:
    """MoLink's public rule: first k >= 3 with (k - 2) x compute >= 2 x transmission, in [P, 2P]."""
    k = 3
    if compute_s <= 0:
        k = 2 * P
    else:
        while (k - 2) * compute_s < 2 * transmission_s and k < 2 * P:
            k += 1
    return max(P, min(2 * P, k))


def is_decode(item: PendingTransfer) -> bool:
    return not item.mb.prefills


class MoLinkPolicy(VllmPolicy):
    Params = MoLinkParams

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._W: dict[int, int] = {}  # link (src stage) -> waiting weight
        self._k: int | None = None
        self._bw: float | None = None
        self._lat: float | None = None
        self._cost = None
        self.transfer_log: list[tuple[int, int, str, int]] = []  # (link, mb, kind, bytes) when logging
        self.log_transfers = False

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"N": trial.suggest_int("N", 5, 60),
                "min_chunk_bytes": trial.suggest_categorical("min_chunk_bytes", [65536, 262144, 1048576]),
                "extension": trial.suggest_categorical("extension", ["off", "rule"])}

    # --- set-up ---------------------------------------------------------------------------------
    def prepare(self, ctx: PrepareContext) -> dict:
        """`extension=search`: simulate every k in [P, 2P] on the first `search_requests`
        requests and keep the k with the lowest `search_metric` (MoLink's emulation step)."""
        if self.params.extension_mode != "search":
            return {}
        P = ctx.pipeline_depth
        scores: dict[int, float] = {}
        for k in range(P, 2 * P + 1):
            summary = ctx.simulate({"extension": k}, self.params.search_requests)
            value = None if summary is None else summary.get(self.params.search_metric)
            scores[k] = float("inf") if value is None else float(value)
        best = min(scores, key=lambda k: (scores[k], k))
        self.params = dataclasses.replace(self.params, extension=best)
        return {"extension_k": best, "extension_scores": scores}

    def start(self, view: SchedulerView) -> None:
        super().start(view)  # vLLM's prompt budget for the model
        self._cost = view.cost_model
        self._bind(view.link_bandwidth_Bps, view.link_latency_s)
        self._k = self._count(view)

    def _bind(self, bandwidth_Bps: float | None, latency_s: float | None) -> None:
        if bandwidth_Bps is not None and latency_s is not None:
            self._bw, self._lat = float(bandwidth_Bps), float(latency_s)

    def _count(self, view: SchedulerView) -> int:
        if view.num_microbatches_pinned:
            return view.num_microbatches
        return self.inflight_for(view.pipeline_depth, view.cost_model)

    def inflight_for(self, P: int, cost) -> int:
        mode = self.params.extension_mode
        if mode == "off":
            return P
        if isinstance(mode, int):
            return max(P, min(2 * P, mode))
        # `search` reaching here means the policy runs without the runner's `prepare` (a unit
        # test): fall back to the rule.
        if cost is None or self._bw is None:
            return P
        compute, trans = self.rule_inputs(cost)
        return extension_rule(P, compute, trans)

    def rule_inputs(self, cost) -> tuple[float, float]:
        shape = BatchShape.decode(self.params.rule_batch_size, self.params.rule_context)
        compute = max(cost.stage_compute_s(s, shape) for s in range(cost.pp))
        trans = self._lat + cost.activation_bytes(shape) / self._bw
        return compute, trans

    def max_inflight(self, view: SchedulerView) -> int:
        if self._k is None:
            self._bind(view.link_bandwidth_Bps, view.link_latency_s)
            self._k = self._count(view)
        return self._k

    # --- batching: vLLM V0 with one virtual engine per micro-batch slot ---------------------------
    # --- transmission scheduling (Algorithm 1) ------------------------------------------------------
    def schedule_transfer(self, link: LinkState, pending: Seq[PendingTransfer]) -> Transfer:
        if self._bw is None:
            self._bind(link.bandwidth_Bps, link.latency_s)
        if not self.params.chunking:
            first = pending[0]
            return self._log(link, Transfer(first, first.remaining_bytes))
        decodes = [x for x in pending if is_decode(x)]
        prefills = [x for x in pending if not is_decode(x)]
        W = self._W.get(link.src, 0)
        if decodes and (not prefills or W < self.params.N):
            if prefills:
                self._W[link.src] = W + 1
            item = decodes[0]
            return self._log(link, Transfer(item, item.remaining_bytes))
        item = prefills[0]
        self._W[link.src] = 0
        if W >= self.params.N:
            return self._log(link, Transfer(item, item.remaining_bytes))
        chunk = int(self.idle_time(link) * link.bandwidth_Bps)
        chunk = max(self.params.min_chunk_bytes, chunk)
        return self._log(link, Transfer(item, min(item.remaining_bytes, chunk)))

    def idle_time(self, link: LinkState) -> float:
        """T_a: how long the link is predicted to stay free of decode activations."""
        info = link.info
        if info.get("upstream_busy") and info.get("upstream_end_s") is not None:
            return max(0.0, info["upstream_end_s"] - link.now_s)  # T_d + t_s - t_c
        if info.get("next_decode_s") is not None:
            return max(0.0, info["next_decode_s"] - link.now_s)
        return self.round_trip_s(link)

    def round_trip_s(self, link: LinkState) -> float:
        """T_o + T_m: a decode batch's way round the pipeline (stage times, link latencies, decode
        activation and token transfer times) -- when the first decode batch comes back."""
        cost = self._cost
        if cost is None:
            return 0.0
        shape = BatchShape.decode(self.params.rule_batch_size, self.params.rule_context)
        T_o = sum(cost.stage_compute_s(s, shape) for s in range(cost.pp))
        hops = cost.pp - 1
        T_m = (hops + 1) * link.latency_s + hops * cost.activation_bytes(shape) / link.bandwidth_Bps \
            + cost.token_return_bytes(shape) / link.bandwidth_Bps
        return T_o + T_m

    def _log(self, link: LinkState, t: Transfer) -> Transfer:
        if self.log_transfers:
            self.transfer_log.append((link.src, t.item.mb.mb_id, "decode" if is_decode(t.item) else "prefill",
                                      t.nbytes))
        return t


register_policy("molink")(MoLinkPolicy)
