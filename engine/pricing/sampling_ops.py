"""GPU sampling priced by the sampling parameters a run uses (issue 46 item 2).

What is measured: the published host tables' `sampler_e2e` rows (gpu-op-profiles/cpu_overheads,
fitted in testbed/calibrate/host_fit.py into `sample_fixed_s` + `sample_per_token_vocab_s`, less
the lm_head GEMM the rows hold and the stage forward prices). Vidur
measured them with `SamplingParams(ignore_eos=True, max_tokens=...)` and nothing else
(vidur/profiling/cpu_overhead/benchmark_runner.py, `_get_input_params`): temperature 1.0, no top-p,
no top-k, no penalties, i.e. plain random sampling. That is the `REFERENCE` path below, and a run
with those settings is priced exactly as the table fit says (byte-identical to before this module).

What is modelled: the kernels vLLM's sampler runs (vllm/model_executor/layers/sampler.py,
`Sampler.forward`, the same in 0.5.3 / 0.7.2 / 0.8.1 v0) over the [rows, vocab] logits for the
run's settings, each priced as a launch floor + its bytes / (peak bandwidth x the efficiency the
device's own kernel tables measured): element-wise kernels at `add_efficiency` (the residual add),
row reductions (softmax, log-softmax, cumsum, argmax) at `norm_efficiency` (RMSNorm, also a row
reduction), launch floor `elementwise_floor_s`. A run is priced as the table's reference path +
(its kernels - the reference path's kernels), so only the difference rests on this form.
- every path: `logits.div_(temperatures)`, `torch.softmax` and `torch.log_softmax` to fp32;
- greedy (`_sample_with_torch`): a copy of the selected rows' logprobs and `argmax`;
- random (`_multinomial`): a copy of the rows' probs, `exponential_`, `div_`, `argmax`;
- penalties, when any of repetition / presence / frequency is set (`_apply_penalties`,
  `_get_bin_counts_and_mask` twice: an int64 [rows, vocab + 1] count per prompt and output, `> 0`
  masks; the repetition factor `repeat`ed to [rows, vocab], masked, `torch.where` of a divide and a
  multiply; frequency x counts and presence x mask subtracted);
- top-k or top-p (`_apply_top_k_top_p`): a full-vocabulary `sort` with int64 indices, the k-th
  threshold mask, `softmax`, `cumsum`, the top-p mask, the inverse permutation (`scatter_`) and the
  `gather` back. The sort is torch's segmented radix sort (cub `DeviceSegmentedRadixSort`,
  `SEGMENTED_RADIX_BITS` = 6 for keys wider than a byte): ceil(key bits / 6) passes, each reading
  the keys once to count and reading and writing keys and indices once to scatter.
Not modelled: min-p, min-tokens, logprobs beyond the sampled token, beam search, `n` > 1, the
host work of building the sampling tensors (in the table's fixed part). A radix pass runs at the
measured `SORT_EFFICIENCY` of the streaming rate (its scattered writes). Checked on a GPU (the H200 of
set G1): docs/measurements/sampling-sort-2026-11-29.md.
"""
from __future__ import annotations

import math

from engine.base.sampling import SamplerSettings

EW, RED = "ew", "red"  # element-wise (add_efficiency), row reduction (norm_efficiency)
SORT = "sort"  # a radix-sort pass: element-wise bytes at SORT_EFFICIENCY of the element-wise rate
# A radix pass's scattered writes run at 18.4% of the element-wise streaming rate: fitted on the H200
# (set G1, torch.sort of fp16 logits, rows 256 / 512 x vocabularies 32k / 128k, top-p + top-k over the
# reference path; testbed/calibrate/gpu_sampling_fit.py, declared in docs/measurements/
# sampling-sort-2026-11-29.md). Priced as a stream (1.0) the extra was 36-35% of the measured; fitted,
# -5.3% to +6.2% on the fit points, and on the held-out `all` setting (penalties too) -4.3% / -5.9% at
# 128k and -18.4% / -31.3% at 32k (its small penalty kernels are launch-bound there).
SORT_EFFICIENCY = 0.1841
RADIX_BITS = 6  # cub DeviceSegmentedRadixSort, SEGMENTED_RADIX_BITS for keys > 1 byte
INDEX_BYTES = 8  # torch.sort's int64 indices; the bin counts are int64 too
PROB_BYTES = 4  # softmax / log_softmax to float32


REFERENCE = SamplerSettings()  # what the host tables measured (Vidur's SamplingParams defaults)


def sampler_kernels(s: SamplerSettings, d: int) -> list[tuple[str, float]]:
    """(kind, bytes per row x vocab entry) of each kernel vLLM's sampler launches for `s`, with
    logits of `d` bytes an element (the model's dtype)."""
    ks = [(EW, 2 * d)]  # logits.div_(temperatures): runs whatever the temperature
    if s.penalties:
        ks += _penalty_kernels(d)
    if s.top_k_top_p:
        ks += _top_k_top_p_kernels(d)
    ks += [(RED, d + PROB_BYTES), (RED, d + PROB_BYTES)]  # softmax, log_softmax
    if s.greedy:
        ks += [(EW, 2 * PROB_BYTES), (RED, PROB_BYTES)]  # logprobs[rows] copy, argmax
    else:
        ks += [(EW, 2 * PROB_BYTES), (EW, PROB_BYTES), (EW, 3 * PROB_BYTES), (RED, PROB_BYTES)]
    return ks


def _penalty_kernels(d: int) -> list[tuple[str, float]]:
    i = INDEX_BYTES
    bincount = [(EW, i), (EW, i + 1)]  # zeros (int64), `> 0` mask; the scatter_add touches only the tokens
    return bincount * 2 + [
        (EW, d),  # repetition factor repeat(1, vocab)
        (EW, 3), (EW, 2),  # prompt_mask | output_mask, ~
        (EW, 1 + i), (EW, i + d),  # boolean-mask assignment: nonzero, then index_put of 1.0
        (EW, d + 1), (EW, 3 * d), (EW, 3 * d), (EW, 1 + 3 * d),  # > 0, divide, multiply, where
        (EW, i + d), (EW, 3 * d),  # frequency x counts, subtract
        (EW, 1 + d), (EW, 3 * d),  # presence x mask, subtract
    ]


def _top_k_top_p_kernels(d: int) -> list[tuple[str, float]]:
    i = INDEX_BYTES
    passes = math.ceil(8 * d / RADIX_BITS)
    sort = [(EW, 2 * d), (EW, i)] + [(SORT, 3 * d + 2 * i)] * passes  # copy keys, iota indices, passes
    return sort + [
        (EW, d + 1), (EW, 1 + 2 * d),  # below the k-th value, masked_fill_
        (RED, 2 * d), (RED, 2 * d),  # softmax, cumsum
        (EW, d + 1), (EW, 1 + 2 * d),  # cumsum <= 1 - p, masked_fill_
        (EW, 3 * i),  # inverse permutation: scatter_ of an arange
        (EW, i + 2 * d),  # gather back to vocabulary order
    ]


def kernels_s(s: SamplerSettings, rows: int, vocab: int, d: int, bw_Bps: float, ew_eff: float,
              red_eff: float, floor_s: float, sort_eff: float = SORT_EFFICIENCY) -> float:
    """Seconds of `sampler_kernels(s, d)` on `rows` x `vocab` logits."""
    entries = rows * vocab
    rate = {EW: bw_Bps * ew_eff, RED: bw_Bps * red_eff, SORT: bw_Bps * ew_eff * sort_eff}
    return sum(floor_s + entries * nbytes / rate[kind] for kind, nbytes in sampler_kernels(s, d))
