"""Token sampling on the last stage: greedy, or temperature / top-k / top-p with a seed.

Sampling runs where the logits are (the GPU on CUDA) and returns the batch's token ids through one
device-to-host copy; penalty state lives on the host and its batch columns move to the logits.

Random sampling gives every (request, position) its own generator, seeded from
(`sample_seed`, request id, position), so a request's tokens do not depend on which other
requests shared its micro-batch, on the policy or on the pipeline depth. Filters apply in
vLLM's order: temperature, then top-k, then top-p (the smallest set of tokens whose
probability reaches p, always keeping the most likely one). With top-k set, top-p runs on the
k candidates `torch.topk` returns (exactly k: a tie at the k-th logit keeps the first k, where a
threshold mask kept every tied token); without it the whole vocabulary is sorted.

Numerically safe for any finite setting: a temperature is at least `MIN_TEMPERATURE`, logits
made infinite or NaN by a tiny temperature or penalty (temperature 1e-45, repetition penalty
1e-300 made the probabilities inf/NaN and `multinomial` raised, killing the stage) are clamped,
and a row whose probabilities are still unusable falls back to greedy.
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 63) - 1
MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy in effect; the division stays finite


def row_seed(sample_seed: int, seq_id: int, position: int) -> int:
    return ((sample_seed * 1_000_003 + seq_id) * 1_000_033 + position) & _MASK64


def sample(logits: torch.Tensor, keys: list[tuple[int, int]], *, method: str = "greedy",
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list[int]:
    """logits [S, vocab] float32; keys[i] = (seq_id, position of the sampled token)."""
    if method == "greedy" or temperature == 0:
        return greedy(logits)
    logits = _finite(logits.float())
    probs, cand = candidate_probs(logits, temperature=max(temperature, MIN_TEMPERATURE), top_k=top_k, top_p=top_p)
    return _draw(probs, cand, logits, keys, seed)


def candidate_probs(x: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after temperature, top-k then top-p on finite logits `x` [S, vocab]:
    (probs [S, n], cand [S, n] token ids) over the candidates, or (probs [S, vocab], None) with
    no top-k/top-p.

    With top-k, `topk` (sorted) is ~linear in the vocabulary and temperature and top-p run on the
    k candidates only (dividing by a temperature keeps the order); the full sort this replaced
    cost 7.7 ms a 152k row on one core (issue 46's measurement). Without top-k, top-p sorts the
    whole vocabulary, O(V log V) a row."""
    if 0 < top_k < x.shape[-1]:
        x, cand = torch.topk(x, top_k, dim=-1)
        x = _finite(x / temperature)
    elif top_p < 1.0:
        x = _finite(x / temperature)
        x, cand = torch.sort(x, dim=-1, descending=True)
    else:
        x, cand = _finite(x / temperature), None
    if top_p < 1.0:
        x = _top_p_sorted(x, top_p)
    return x.softmax(dim=-1), cand


def _top_p_sorted(sorted_x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop (to -inf) the tail of descending `sorted_x` rows beyond the smallest set whose
    probability reaches p; the most likely token always stays."""
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop = before >= top_p
    drop[:, 0] = False
    return sorted_x.masked_fill(drop, float("-inf"))


def _draw(probs: torch.Tensor, cand: torch.Tensor | None, logits: torch.Tensor,
          keys: list[tuple[int, int]], seed: int) -> list[int]:
    """One draw per row from `probs` (over the vocabulary, or over `cand`'s token ids), with the
    row's own generator; a row with unusable probabilities takes its most likely token."""
    usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
    out = []
    g = torch.Generator(device=logits.device)
    for i, (seq_id, pos) in enumerate(keys):
        if not usable[i]:  # nothing left to draw from: the most likely token
            out.append(logits[i].argmax().reshape(1))
            continue
        g.manual_seed(row_seed(seed, seq_id, pos))
        j = torch.multinomial(probs[i], 1, generator=g)
        out.append(j if cand is None else cand[i, j])
    # one device-to-host copy for the whole batch (the draws stay on the logits' device)
    return torch.cat(out).tolist() if out else []


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's most likely token (the first on ties; a NaN counts as the largest, as in torch).

    On the host, numpy's argmax: torch's CPU argmax over a [64, 32000] float32 batch took 1.8 ms
    with one thread and 8.1 ms with two on this project's 2-core machine, numpy's 0.16 ms; it was
    a third of a tiny-llama decode step's host time (sample 1.94 of 3.4 ms at 64 x 512)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _finite(x: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never drawn), +inf -> the largest finite value (softmax stays defined).

    A finite sum means every entry is finite (an overflowing sum only takes the copying path):
    the copy of a [8, 152k] batch cost 1.7-2.3 ms of thread CPU time on this machine, mostly
    the page faults of a fresh 4.9 MB buffer, 10x the top-k sampling itself."""
    if bool(torch.isfinite(x.sum())):  # all finite (one read, no [S, vocab] buffer): as it is
        return x
    big = torch.finfo(x.dtype).max
    return torch.nan_to_num(x, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def apply_penalties(logits: torch.Tensor, counts_vm: torch.Tensor, seen_vm: torch.Tensor, *,
                    repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """vLLM's penalties, in place on `logits` [S, vocab] through its vocab-major view [vocab, S].

    counts_vm [vocab, S]: how often each token was generated by each row's sequence; seen_vm
    [vocab, S] bool: tokens in its prompt. Repetition (prompt or output tokens): a positive logit
    is divided by r, a negative one multiplied by r; then frequency (minus f x count) and presence
    (minus p if generated at all)."""
    gen = counts_vm > 0
    rows, cols = (seen_vm | gen).t().nonzero(as_tuple=True)
    return penalise_at(logits, rows, cols, counts_vm.t()[rows, cols], repetition=repetition, presence=presence,
                       frequency=frequency)


def penalise_at(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, counts: torch.Tensor, *,
                repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """vLLM's penalties at the entries (rows[i], cols[i]) a row's sequence has seen or generated
    (counts[i] times), in place on `logits` [S, vocab]; every other entry is left as it is, which
    is what the dense form does to it (nothing, or minus 0). Gathering the hit entries: the dense
    form -- a dozen full [vocab, S] passes -- cost 1.7 ms a 152k row on one core, 7x the
    top-k/top-p sampling after it."""
    if not rows.numel() or (repetition == 1.0 and frequency == 0.0 and presence == 0.0):
        return logits
    v = logits[rows, cols]
    if repetition != 1.0:
        v = torch.where(v > 0, v / repetition, v * repetition)
    if frequency != 0.0:
        v = v - frequency * counts.to(v.dtype)
    if presence != 0.0:
        v = v - presence * (counts > 0).to(v.dtype)
    logits[rows, cols] = v
    return logits


class Sampler:
    """Sampling with per-sequence penalty state: the same object samples inline on the last stage
    and in each CPU sampler process, so both paths give the same tokens.

    State per sequence (its vocab-long column of generated-token counts, prompt-token flags and
    their union, the hit flags) is updated in place after each sampled token; a micro-batch's
    penalties touch only its rows' hit entries (`penalise_at`). A prefill chunk starting at 0 (a new or recomputed
    sequence) resets the sequence's state; recomputed output tokens then count as prompt tokens
    for the repetition penalty (frequency/presence restart from 0) -- a documented simplification."""

    def __init__(self, vocab: int, *, method: str = "greedy", temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> None:
        self.vocab = vocab
        self.kw = dict(method=method, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        self.rep, self.pres, self.freq = repetition_penalty, presence_penalty, frequency_penalty
        self.penalties = repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0
        self.counts: dict[int, torch.Tensor] = {}
        self.seen: dict[int, torch.Tensor] = {}
        self.hit: dict[int, torch.Tensor] = {}  # seen | generated: the entries the penalties touch
        self.per_seq: dict[int, tuple] = {}  # seq id -> SamplingParams.as_tuple() (served requests)

    def set_params(self, params: dict[int, tuple]) -> None:
        """Per-request sampling of served requests (engine/core/request.py `SamplingParams`): their
        rows are sampled one by one with their own settings; a request's `seed` keys its draws
        by position only, so the same seed and prompt give the same tokens in any request."""
        self.per_seq.update(params)

    def _tracks(self, seq_id: int) -> bool:
        p = self.per_seq.get(seq_id)
        return self.penalties or (p is not None and (p[4] != 1.0 or p[5] != 0.0 or p[6] != 0.0))

    def observe_prefill(self, seq_id: int, start: int, token_ids) -> None:
        if not self.penalties and not (self.per_seq and self._tracks(seq_id)):
            return
        if start == 0 or seq_id not in self.seen:
            self.seen[seq_id] = torch.zeros(self.vocab, dtype=torch.bool)
            self.counts[seq_id] = torch.zeros(self.vocab, dtype=torch.int32)
            self.hit[seq_id] = torch.zeros(self.vocab, dtype=torch.bool)
        if len(token_ids):
            ids = torch.as_tensor(list(token_ids), dtype=torch.long)
            self.seen[seq_id][ids] = True
            self.hit[seq_id][ids] = True

    def sample(self, logits: torch.Tensor, keys: list[tuple[int, int]]) -> list[int]:
        if self.per_seq and any(sid in self.per_seq for sid, _ in keys):
            return [self._sample_row(logits[i:i + 1], key) for i, key in enumerate(keys)]
        if self.penalties and keys:
            for sid, _ in keys:
                if sid not in self.seen:
                    self.observe_prefill(sid, 0, ())
            # per-sequence state stays on the host; the batch's hit entries go to the logits' device
            cols = [self.hit[s].nonzero().flatten() for s, _ in keys]
            rows = torch.repeat_interleave(torch.arange(len(keys)), torch.tensor([len(c) for c in cols]))
            counts = torch.cat([self.counts[s][c] for (s, _), c in zip(keys, cols)])
            logits = logits.float()
            if logits.is_inference() and not torch.is_inference_mode_enabled():
                logits = logits.clone()  # a model output (inference_mode) cannot change in place here
            dev = logits.device
            rows, cols = rows.to(dev), torch.cat(cols).to(dev)
            kept = logits[rows, cols]
            # in place, then the touched entries put back: no copy of the batch (see `_finite`)
            penalise_at(logits, rows, cols, counts.to(dev), repetition=self.rep, presence=self.pres,
                        frequency=self.freq)
            try:
                tokens = sample(logits, keys, **self.kw)
            finally:
                logits[rows, cols] = kept
        else:
            tokens = sample(logits, keys, **self.kw)
        if self.penalties:
            for (sid, _), tok in zip(keys, tokens):
                self.counts[sid][tok] += 1  # in place: the next micro-batch of this sequence sees it
                self.hit[sid][tok] = True
        return tokens

    def _sample_row(self, row: torch.Tensor, key: tuple[int, int]) -> int:
        sid, pos = key
        p = self.per_seq.get(sid)
        if p is None:
            return self.sample(row, [key])[0]  # a run-sampled row beside served ones
        temperature, top_p, top_k, seed, rep, pres, freq = p
        if rep != 1.0 or pres != 0.0 or freq != 0.0:
            if sid not in self.seen:
                self.observe_prefill(sid, 0, ())
            row = row.float().clone()
            apply_penalties(row, self.counts[sid][:, None].to(row.device), self.seen[sid][:, None].to(row.device),
                            repetition=rep, presence=pres, frequency=freq)
        method = "greedy" if temperature == 0 else "random"
        row_key = (0, pos) if seed is not None else key
        tok = sample(row, [row_key], method=method, temperature=temperature or 1.0, top_k=top_k, top_p=top_p,
                     seed=self.kw["seed"] if seed is None else seed)[0]
        if sid in self.counts:
            self.counts[sid][tok] += 1
            self.hit[sid][tok] = True
        return tok
