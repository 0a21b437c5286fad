"""TD-Pipe, temporally-disaggregated pipeline (ICPP'25; docs/policies-specialised.md#tdpipe): offline throughput.

The engine alternates long prefill-only phases and long decode-only phases, so that the P
micro-batches in flight are alike (all prefill or all decode) and the pipeline has few bubbles.

- Prefill phase: prefill-only micro-batches of whole prompts, FCFS (recomputations first), closed
  once they reach `prefill_tokens` tokens (the crossing prompt included, as the public code
  does), KV reserved for the whole prompt. "AI-based greedy prefill": every request has a
  predicted output length (`policy.predictor`, see policies/length_predictor.py); a forecast
  keeps, for each future decode point f, the KV blocks the admitted requests will hold f steps
  from now (blocks(len + f) for each request whose predicted remaining length is >= f). After
  each prefill micro-batch the forecast grows; the phase ends when the forecast exceeds
  `kv_capacity` x the KV blocks (paper: 1.0; the public code: 0.9), when no prompt waits, or
  when the next prompt does not fit the KV cache now.
- Decode phase: the running requests are split into P equal decode micro-batches (sizes
  N//P, +1 for the first N%P). Inter-batch work stealing: when a decode micro-batch returns, its
  finished requests are dropped, its remaining size enters a sliding window of the last P batch
  sizes; above the window's average (rounded up) the excess is withheld in a pool ("stolen") and
  the batch is resubmitted at the average; below it, it is topped up from the pool (WorkStealer).
  `work_stealing=false` keeps the initial split. `steal_rule="even"` is the public code's rule:
  every decode micro-batch takes total//P (+1 for the first total%P of each round) of the idle
  requests, longest idle first.
- Decode -> prefill, checked once per round of P decode micro-batches: switch when the spatial
  intensity of the current decode batch is below the temporal intensity of the prefill phase it
  would start: SI(b) = (b/T(b)) / (b_peak/T(b_peak)) with b = running requests // P and T the cost
  model's decode step time (at the running requests' mean context), SI = 1 for b >= b_peak;
  TI = 1 - bubble/total with the prefill micro-batches the forecast would admit now, of times
  t_i (cost model), bubble = max(0, max t_i - T(b)) x (P-1), total = sum t_i + bubble (paper);
  `intensity_rule="code"` takes total = sum t_i + max t_i x (P-1) and T at the size the decode
  batches will have after those prefills.
- KV overflow in a decode phase: recomputation; the most recently admitted ("recently arrived")
  idle request is preempted and re-prefilled in the next prefill phase.

Ablations (the paper's): `switch_kv_ratio` (switch to decode once KV usage reaches this ratio,
instead of the predictor's forecast; TI planning then admits prompts up to that ratio too),
`switch_finish_ratio` (switch to prefill once this fraction of the decode phase's requests
finished, instead of the intensity rule), `work_stealing=false`. The predictor ablations are
`predictor=oracle` (true lengths) and `predictor=mean`.

Measured in the simulator (5,000 ShareGPT requests, outputs <= 3,072, offline; Llama2-70B on
4 x A100-80GB): 4,956 tok/s against 3,704 for vLLM-style separate batching and 3,855 for Sarathi
with 1,024 sequences; stealing off -1.9%; best fixed KV ratio (0.65) -2.3%; best fixed finish
ratio (0.6) -1.0%; `prefill_tokens` 512 / 1024 / 2048 / 4096: -3.7% / -1.0% / best / -0.3%.

Offline setting: the policy reads every request's prompt (`view.all_requests`) at start to
predict output lengths; it never reads their output lengths unless `predictor=oracle`.

What `bins` (and `mean`) are trained on, so that a run is never tested on its training data
(`policy.predictor_info` records which case applied):
1. `predictor_model=<dir>`: that model, saved by `length_predictor.train_predictor`; a
   ConfigError if it was trained on any request of this run.
2. else `<predictor_dir>/<data set>-<features>` (train_predictor's default name) when it exists
   and was trained on none of this run's requests;
3. else a fit at start on the run's data set minus the run's own requests
   (`view.history`, found by workloads/history.py): ShareGPT runs use the pairs file with the same
   tokenizer's counts and prompt lengths within the run's range; Azure runs use every row of the
   matching trace; 80% fits, 20% picks the classifier. Workloads with no data set behind them
   (synthetic) fall back to the run's own requests with a warning (`history=run` asks for it).
"""
from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from engine.base.errors import ConfigError, bad_value
from engine.core.policy import History, Policy, SchedulerView, register_policy
from engine.core.request import SeqStatus, Sequence
from policies import length_predictor as lp
from policies import prediction_cache
from policies.common import IdleOrder, add_decode_or_preempt, idle_decodes
from policies.tdpipe_forecast import KVForecast, parse_points

_DECODING = SeqStatus.DECODING  # `SeqStatus.DECODING` in a comprehension is two lookups per sequence


@dataclass(frozen=True)
class TdpipeParams:
    predictor: str = "bins"  # oracle | mean | bins (TD-Pipe's classifier)
    predictor_features: str = "auto"  # bins only: auto | hash | minilm | length
    predictor_model: str | None = None  # a model saved by train_predictor; None = train on history minus the run
    history: str = "auto"  # auto: the run's data set minus the run; run: the run itself (leaks)
    predictor_dir: str = lp.DEFAULT_DIR  # minilm embedding cache lives in <predictor_dir>/cache
    data_dir: str | None = None  # where the history data is, if not $TESTBED_DATA_DIR or the cache
    future_points: str = "paper"  # paper (32..1024 by 32) | code (5, 8, ..., 4096) | "a,b,c"
    kv_capacity: float = 1.0  # forecast limit as a fraction of KV blocks (paper 1.0; code 0.9)
    prefill_tokens: int = 2048  # a prefill micro-batch closes once it holds this many tokens
    switch_kv_ratio: float | None = None  # ablation: prefill -> decode at this KV usage (0.2 .. 0.95)
    switch_finish_ratio: float | None = None  # ablation: decode -> prefill at this finished fraction
    work_stealing: bool = True  # False: the initial even split only
    steal_rule: str = "window"  # window (paper: sliding window of P batches) | even (code: total//P)
    b_peak: int = 256  # SI's reference batch size (the public code's 256)
    intensity_rule: str = "paper"  # paper | code (see the module docstring)
    seed: int = 0  # predictor training
    prediction_cache: bool = True  # reuse the predictions of an identical fit (policies/prediction_cache.py)

    def __post_init__(self) -> None:
        if self.predictor not in lp.PREDICTORS:
            raise bad_value("policy.predictor", self.predictor, f"must be one of {', '.join(lp.PREDICTORS)}")
        if self.predictor_features not in lp.FEATURES:
            raise bad_value("policy.predictor_features", self.predictor_features,
                            f"must be one of {', '.join(lp.FEATURES)}")
        if self.history not in ("auto", "run"):
            raise bad_value("policy.history", self.history, "must be auto or run")
        parse_points(self.future_points)
        if not 0.0 < self.kv_capacity <= 1.0:
            raise bad_value("policy.kv_capacity", self.kv_capacity, "must be in (0, 1]")
        if self.prefill_tokens < 1:
            raise bad_value("policy.prefill_tokens", self.prefill_tokens, "must be >= 1")
        for key in ("switch_kv_ratio", "switch_finish_ratio"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0):
                raise bad_value(f"policy.{key}", v, "must be in (0, 1] or null (off)")
        if self.steal_rule not in ("window", "even"):
            raise bad_value("policy.steal_rule", self.steal_rule, "must be window or even")
        if self.b_peak < 1:
            raise bad_value("policy.b_peak", self.b_peak, "must be >= 1")
        if self.intensity_rule not in ("paper", "code"):
            raise bad_value("policy.intensity_rule", self.intensity_rule, "must be paper or code")


# --------------------------------------------------------------------------- pure pieces
def _leading_lengths(waiting: list[Sequence], used: int, threshold: float, block_size: int) -> np.ndarray:
    """prefill_target of the leading waiting sequences, up to and including the first one whose
    predecessors' prompt blocks (plus `used`) reach `threshold`: no later one can enter the plan.
    The plan runs once per round of P decode batches; reading all 5,000 waiting prompts each
    time was 5% of TD-Pipe's benchmark run (py-spy)."""
    k = 256
    while True:
        lengths = np.array([s.request.prompt_len + s.num_generated for s in waiting[:k + 1]])
        if k + 1 >= len(waiting) or used + int((-(-lengths[:k] // block_size)).sum()) >= threshold:
            return lengths
        k *= 4


class WorkStealer:
    """TD-Pipe's inter-batch work stealing over a sliding window of the last `depth` batch sizes.

    `start(sizes)` seeds the window with the initial split; `resubmit(alive)` takes a returned
    batch's unfinished requests and returns the batch to resubmit: above the window's average
    (rounded up, so the pool drains) the excess goes to `pool`; below it the batch is topped up
    from `pool`, oldest first. Disabled, it returns `alive` plus whatever waits in the pool.
    """

    def __init__(self, depth: int, enabled: bool = True) -> None:
        self.depth = depth
        self.enabled = enabled
        self.window: deque[int] = deque(maxlen=depth)
        self.pool: list[Any] = []

    def start(self, sizes: Seq[int]) -> None:
        self.window.clear()
        self.window.extend(sizes)

    @property
    def average(self) -> float:
        return sum(self.window) / len(self.window) if self.window else 0.0

    @property
    def target(self) -> int:
        return math.ceil(self.average - 1e-9)

    def take(self, n: int) -> list[Any]:
        out, self.pool = self.pool[:n], self.pool[n:]
        return out

    def resubmit(self, alive: list[Any]) -> list[Any]:
        if not self.enabled:
            return alive + self.take(len(self.pool))
        self.window.append(len(alive))
        t = self.target
        if len(alive) > t:
            self.pool.extend(alive[t:])
            return alive[:t]
        if len(alive) < t:
            return alive + self.take(t - len(alive))
        return alive


def spatial_intensity(step_time: Callable[[int], float], b: int, b_peak: int) -> float:
    """SI(b) = (b / T(b)) / (b_peak / T(b_peak)); 1 at or above b_peak, 0 for an empty batch."""
    if b <= 0:
        return 0.0
    if b >= b_peak:
        return 1.0
    return (b / step_time(b)) / (b_peak / step_time(b_peak))


def temporal_intensity(prefill_times: Seq[float], decode_time: float, depth: int, rule: str = "paper") -> float:
    """TI = 1 - bubble/total of the prefill phase that would start now (0 if it would be empty)."""
    if not prefill_times:
        return 0.0
    longest, work = max(prefill_times), sum(prefill_times)
    bubble = max(0.0, longest - decode_time) * (depth - 1)
    total = work + (bubble if rule == "paper" else longest * (depth - 1))
    return 1.0 - bubble / total if total > 0 else 0.0


# --------------------------------------------------------------------------- the policy
_FITTED: dict[tuple, lp.LengthPredictor] = {}  # in-process cache (4 newest): sweeps refit nothing


@register_policy("tdpipe")
class TdpipePolicy(Policy):
    Params = TdpipeParams

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self.points = parse_points(self.params.future_points)
        self.pred: dict[int, int] = {}
        self._fallback = 1
        self._pred_table: tuple[dict, np.ndarray] | None = None  # (pred it was built from, id -> prediction)
        self.predictor_info: dict[str, Any] = {}
        self.phase = "prefill"
        self.epoch = 0  # decode phases started
        self.forecast: KVForecast | None = None
        self.stealer: WorkStealer | None = None
        self._pending: deque[list[Sequence]] = deque()
        self._initial: deque[int] = deque()
        self._decode_batches = 0  # in this decode phase
        self._checked_at = 0  # value of _decode_batches at the last decode -> prefill check
        self._phase_start = 0  # requests at the start of this decode phase
        self._phase_finished = 0
        self._idle = IdleOrder()
        self.switches: list[tuple[float, str]] = []  # (time, new phase), for traces and tests

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"prefill_tokens": trial.suggest_categorical("prefill_tokens", [256, 512, 1024, 2048, 4096]),
                "kv_capacity": trial.suggest_float("kv_capacity", 0.8, 1.0),
                "b_peak": trial.suggest_categorical("b_peak", [128, 192, 256, 384]),
                "future_points": trial.suggest_categorical("future_points", ["paper", "code"])}

    # --- start: predictions ----------------------------------------------------------------------
    def start(self, view: SchedulerView) -> None:
        p = self.params
        run = [r for r in view.all_requests]
        self.forecast = KVForecast(self.points, view.block_size)
        self.stealer = WorkStealer(self.max_inflight(view), p.work_stealing)
        predictions, info = self._predictions(run, view)
        self.pred = {r.request_id: int(x) for r, x in zip(run, predictions)}
        self._fallback = int(np.median(list(self.pred.values()))) if self.pred else 1
        self.predictor_info = info

    def _predictions(self, run: list, view: SchedulerView) -> tuple[np.ndarray, dict]:
        """One predicted output length per request of `run`, and how they were made."""
        p = self.params
        cache_dir = f"{p.predictor_dir}/cache"
        if p.predictor == "oracle":
            return lp.OraclePredictor().predict(run), {"predictor": "oracle"}
        if p.predictor_model is not None and p.predictor == "bins":
            model, meta = lp.load_for_run(p.predictor_model, run, cache_dir)
            return model.predict(run), {"predictor": "bins", "model": p.predictor_model,
                                        "trained_on": meta.get("dataset"), "classifier": model.chosen,
                                        "features": model.features}
        if p.predictor_model is not None:
            raise ConfigError(f"policy.predictor_model is for predictor=bins, not {p.predictor!r}")
        hist = view.history(p.history, p.data_dir)
        if hist is None:  # a controller built by hand, without the runner's history provider
            if p.history == "auto":
                warnings.warn("TD-Pipe length predictor: no history provider; training on the run's own "
                              "requests (leaks)", stacklevel=2)
            hist = History("run (leaks: no history provider)", tuple(run))
        note = None
        if p.predictor == "bins" and hist.dataset is not None:
            # A model saved by train_predictor for this data set is used when it was not trained
            # on any of this run's requests (with ShareGPT's 9,902 pairs it usually was).
            feats = p.predictor_features if p.predictor_features != "auto" else (
                "hash" if all(r.prompt_text for r in run) else "length")
            saved = Path(p.predictor_dir) / f"{hist.dataset}-{feats}"
            if lp.BinPredictor.is_saved_at(saved):
                try:
                    model, meta = lp.load_for_run(saved, run, cache_dir)
                except ConfigError as exc:
                    note = f"saved model {saved} not used: {exc}"
                else:
                    return model.predict(run), {"predictor": "bins", "model": str(saved),
                                                "trained_on": meta.get("dataset"), "classifier": model.chosen,
                                                "features": model.features}
        info = {"predictor": p.predictor, "history": hist.source, "history_size": len(hist.requests)}
        if note:
            info["note"] = note
        return self._fitted_predictions(run, hist, info, cache_dir)

    def _fitted_predictions(self, run: list, hist: History, info: dict, cache_dir: str) -> tuple[np.ndarray, dict]:
        """Fit on `hist` and predict `run`; read back from / written to the prediction cache
        (policies/prediction_cache.py: a hit skips scikit-learn, 2.5 s and ~190 MB here)."""
        p = self.params
        settings = (p.predictor, p.predictor_features, p.seed)
        hist_keys = prediction_cache.fingerprints(hist.requests)
        if p.prediction_cache:
            key = prediction_cache.cache_key(settings, hist_keys, prediction_cache.fingerprints(run))
            hit = prediction_cache.load(f"{cache_dir}/predictions", key, len(run))
            if hit is not None:
                return hit[0], {**hit[1], "predictions": "cache"}
        key_in_process = (*settings, hash(hist_keys))
        model = _FITTED.get(key_in_process)
        if model is None:
            model = lp.make_predictor(p.predictor, p.predictor_features, p.seed, cache_dir)
            if p.predictor == "bins":
                order = np.random.default_rng(p.seed).permutation(len(hist.requests))
                cut = int(0.8 * len(order))  # 80% fits, 20% validates the model choice
                model.fit([hist.requests[i] for i in order[:cut]], [hist.requests[i] for i in order[cut:]])
            else:
                model.fit(hist.requests)
            while len(_FITTED) >= 4:  # a hashed-feature model is ~10 MB
                del _FITTED[next(iter(_FITTED))]
            _FITTED[key_in_process] = model
        if isinstance(model, lp.BinPredictor):
            info.update(classifier=model.chosen, features=model.features)
        predictions = np.array([int(x) for x in model.predict(run)], dtype=np.int64)
        if p.prediction_cache:
            prediction_cache.store(f"{cache_dir}/predictions", key, predictions, info)
        return predictions, {**info, "predictions": "fit"}

    def remaining_pred(self, seq: Sequence) -> int:
        return max(0, self.pred.get(seq.seq_id, self._fallback) - seq.num_generated)

    def remaining_preds(self, seqs) -> np.ndarray:
        """`remaining_pred` of each sequence, as int64 (the plan runs it over the whole running
        set: 1.5M sequences in the 5,000-request benchmark): predictions gathered from an
        id-indexed table, 47 us per 1,000 sequences instead of 177 us as a comprehension."""
        ids = np.array([s.seq_id for s in seqs], dtype=np.int64)
        generated = np.array([s.num_generated for s in seqs], dtype=np.int64)
        table = self._prediction_table()
        if len(ids) and 0 <= ids.min() and ids.max() < len(table):
            pred = table[ids]
        else:  # ids outside the run's requests (served ones): the dict, with its fallback
            get, fallback = self.pred.get, self._fallback
            pred = np.fromiter(map(get, ids.tolist(), repeat(fallback)), dtype=np.int64, count=len(ids))
        return np.maximum(pred - generated, 0)

    def _prediction_table(self) -> np.ndarray:
        """`pred` as an array indexed by request id, the fallback where no request has the id
        (empty if an id is negative: every lookup then goes through the dict)."""
        if self._pred_table is None or self._pred_table[0] is not self.pred:
            ok = bool(self.pred) and min(self.pred) >= 0
            table = np.full(max(self.pred) + 1 if ok else 0, self._fallback, dtype=np.int64)
            if ok:
                table[list(self.pred)] = list(self.pred.values())
            self._pred_table = (self.pred, table)
        return self._pred_table[1]

    # --- phase rules -------------------------------------------------------------------------------
    def should_enter_decode(self, view: SchedulerView) -> bool:
        """Prefill -> decode: no prompt waits, or the KV plan is full (forecast or the ablation's
        fixed KV ratio)."""
        if not view.waiting:
            return True
        p = self.params
        if p.switch_kv_ratio is not None:
            return 1.0 - view.kv_free_fraction >= p.switch_kv_ratio
        return self.forecast.peak > p.kv_capacity * view.kv_total_blocks

    def intensities(self, view: SchedulerView) -> tuple[float, float]:
        """(SI, TI) of the current state (see the module docstring)."""
        p = self.params
        P = self.max_inflight(view)  # decode batches per round (P by default)
        cm = view.cost_model
        running = list(view.running)
        ctx = max(1, round((sum([s.num_computed for s in running]) + len(running)) / len(running))) if running else 1
        b = len(running) // P
        si = spatial_intensity(lambda x: cm.decode_step_s(x, ctx), b, p.b_peak)
        batches = self.plan_prefills(view)
        admitted = sum(n for _, n in batches)
        times = [cm.prefill_s(tok, n) for tok, n in batches]
        b_dec = b if p.intensity_rule == "paper" else (len(running) + admitted) // P
        t_dec = cm.decode_step_s(max(1, b_dec), ctx)
        return si, temporal_intensity(times, t_dec, P, p.intensity_rule)

    def plan_prefills(self, view: SchedulerView) -> list[tuple[int, int]]:
        """The prefill micro-batches (tokens, prompts) a prefill phase starting now would run."""
        p = self.params
        waiting = list(view.waiting)
        if not waiting:
            return []
        used = view.kv_total_blocks - view.kv_free_blocks
        threshold = (p.kv_capacity if p.switch_kv_ratio is None else p.switch_kv_ratio) * view.kv_total_blocks
        lengths = _leading_lengths(waiting, used, threshold, view.block_size)
        before = used + np.concatenate([[0], np.cumsum(-(-lengths // view.block_size))[:-1]])
        if p.switch_kv_ratio is not None:
            ok = before < p.switch_kv_ratio * view.kv_total_blocks
            n = len(waiting) if ok.all() else int(np.argmin(ok))
        else:
            # The prompts' own blocks bound how many the forecast can admit: look no further.
            cap = threshold
            limit = int(np.searchsorted(before, cap, side="left")) + 1
            fc = KVForecast(self.points, view.block_size)
            run = list(view.running)
            fc.add([s.request.prompt_len + s.num_generated for s in run], self.remaining_preds(run))  # total_len
            n = fc.admissible(lengths[:limit], self.remaining_preds(waiting[:limit]), cap)
        batches, tok, cnt = [], 0, 0
        for x in lengths[:n]:
            tok += int(x)
            cnt += 1
            if tok >= p.prefill_tokens:
                batches.append((tok, cnt))
                tok = cnt = 0
        if cnt:
            batches.append((tok, cnt))
        return batches

    def should_enter_prefill(self, view: SchedulerView) -> bool:
        """Decode -> prefill: prompts wait and (nothing runs, or the ablation's finish ratio is
        reached, or SI < TI)."""
        if not view.waiting:
            return False
        if view.num_running == 0:
            return True
        p = self.params
        if p.switch_finish_ratio is not None:
            return self._phase_finished >= p.switch_finish_ratio * max(1, self._phase_start)
        si, ti = self.intensities(view)
        return si < ti

    # --- phase changes -----------------------------------------------------------------------------
    def _enter_prefill(self, view: SchedulerView) -> None:
        self.phase = "prefill"
        self.switches.append((view.now, "prefill"))
        self._pending.clear()
        self._initial.clear()
        self.stealer.pool.clear()
        self.forecast.reset()
        run = list(view.running)
        self.forecast.add([s.total_len for s in run], self.remaining_preds(run))

    def _enter_decode(self, view: SchedulerView) -> None:
        self.phase = "decode"
        self.switches.append((view.now, "decode"))
        self.epoch += 1
        P = self.max_inflight(view)  # decode batches per round (P by default)
        idle = self._idle_decodes(view)
        coming = sum(1 for mb in view.inflight for s in mb.sequences() if s.remaining_output > 1)
        n = len(idle) + coming
        sizes = [n // P + (i < n % P) for i in range(P)]
        self.stealer.start(sizes)
        self.stealer.pool = idle
        self._initial = deque(sizes)
        self._pending.clear()
        self._decode_batches = 0
        self._checked_at = 0  # no intensity check before the first round
        self._phase_start = n
        self._phase_finished = 0

    def _idle_decodes(self, view: SchedulerView) -> list[Sequence]:
        idle = idle_decodes(view)
        self._idle.sort(idle)  # longest idle first
        return idle

    # --- the hooks ---------------------------------------------------------------------------------
    def schedule(self, view: SchedulerView):
        for _ in range(3):  # at most two phase changes per call
            if self.phase == "prefill":
                if self.should_enter_decode(view) and (view.num_running or view.num_inflight):
                    self._enter_decode(view)
                    continue
                mb = self._prefill_batch(view)
                if mb is not None or not (view.num_running or view.num_inflight):
                    return mb  # None here: nothing waits (or arrives later) and nothing runs
                self._enter_decode(view)  # the next prompt does not fit the KV cache now
                continue
            P = self.max_inflight(view)  # decode batches per round (P by default)
            if self._decode_batches % P == 0 and self._decode_batches != self._checked_at:
                self._checked_at = self._decode_batches  # once per round of P decode batches
                if self.should_enter_prefill(view):
                    self._enter_prefill(view)
                    continue
            mb = self._decode_batch(view)
            if mb is not None or view.num_inflight:
                return mb  # None: this slot waits for a returning batch
            # Nothing in flight and nothing to decode in this slot: never let the run stall.
            if self._idle_decodes(view):
                self._enter_decode(view)
            elif view.waiting:
                self._enter_prefill(view)
            else:
                return None
        return None

    def _prefill_batch(self, view: SchedulerView):
        p = self.params
        b = view.new_batch()
        b.tags.update(phase="prefill", epoch=self.epoch)
        for seq in view.waiting:
            if b.num_prefill_tokens >= p.prefill_tokens:
                break
            if not b.add_prefill(seq, seq.remaining_prefill, reserve_tokens=seq.prefill_target):
                break
        mb = view.finish(b)
        if mb is not None:
            seqs = [c.seq for c in mb.prefills]
            self.forecast.add([s.prefill_target for s in seqs], self.remaining_preds(seqs))
        return mb

    def _decode_members(self, view: SchedulerView) -> list[Sequence]:
        P = self.max_inflight(view)  # decode batches per round (P by default)
        if self.params.steal_rule == "even":
            total = view.num_decoding  # kept by the controller
            k = self._decode_batches % P
            return self._idle_decodes(view)[:max(1, total // P + (k < total % P))]  # >= 1: fewer than P left
        ws = self.stealer
        ws.pool = [s for s in ws.pool if s.status is _DECODING and not s.in_flight]
        while self._pending:
            members = [s for s in self._pending.popleft() if s.status is _DECODING and not s.in_flight]
            if members:
                return members
        if self._initial:
            return ws.take(self._initial.popleft())
        return ws.take(ws.target if ws.enabled else len(ws.pool))

    def _decode_batch(self, view: SchedulerView):
        members = self._decode_members(view)
        if not members:
            return None
        b = view.new_batch()
        b.tags.update(phase="decode", epoch=self.epoch)
        victims = None  # built on the first KV shortage only (the common case never needs it)
        members = [s for s in members if s.status is _DECODING]
        first = b.add_decodes(members, len(members))  # all that fit in one call, the common case
        for seq in members[first:]:
            if seq in b or b.add_decode(seq):
                continue
            if victims is None:
                victims = sorted(idle_decodes(view),
                                 key=lambda s: s.admit_order)
            add_decode_or_preempt(b, seq, victims)
        mb = view.finish(b)
        if mb is not None:
            self._decode_batches += 1
        return mb

    def on_complete(self, view: SchedulerView, micro_batch, finished) -> None:
        self._idle.on_complete(micro_batch, finished)
        if self.phase != "decode":
            return
        self._phase_finished += len(finished)
        alive = [s for s in micro_batch.sequences() if s.status is _DECODING]
        if self.params.steal_rule == "even":
            return
        if micro_batch.tags.get("phase") == "decode" and micro_batch.tags.get("epoch") == self.epoch:
            self._pending.append(self.stealer.resubmit(alive))
        else:  # a prefill batch (or a decode batch of an earlier phase) returned: its requests join the pool
            self.stealer.pool.extend(alive)
