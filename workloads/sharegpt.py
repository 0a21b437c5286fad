"""ShareGPT first-turn pairs: real prompt texts and lengths, with generated arrivals.

The pairs file (`sharegpt/sharegpt_pairs.jsonl.gz`, built by `workloads.sharegpt_build`) holds
token counts for two tokenizers. `tokenizer="llama3"` uses the Llama-3 counts plus 1 for the
BOS token a Llama server prepends (the file counts without special tokens); `"qwen3"` uses the
Qwen3 counts as they are (Qwen adds no BOS). Length filters apply to those counts.

`num_requests` pairs are drawn WITHOUT replacement from the pairs passing the filters (asking
for more than exist is an error, never a silent repeat). The draw and the arrivals use two
independent streams derived from `seed`, so changing the arrival process or rate keeps the same
prompts, and changing the filters keeps the same arrival pattern.
"""
from __future__ import annotations

import functools
import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.base.errors import TestbedError, bad_value
from engine.core.request import Request
from engine.base.typed import setting
from workloads.arrivals import ARRIVAL_PROCESSES, MAX_RATE, MIN_RATE, arrival_times, check_arrival
from workloads.base import MAX_TOKENS, WORKLOADS, WorkloadSpec, check_range, check_types, key, make_requests
from workloads.data import SHAREGPT_PAIRS, resolve_data_file

TOKENIZERS = {"llama3": ("input_tokens", "output_tokens", 1), "qwen3": ("input_tokens_qwen3", "output_tokens_qwen3", 0)}
FIELDS = ("id", "prompt", "input_tokens", "output_tokens", "input_tokens_qwen3", "output_tokens_qwen3")


@dataclass(frozen=True)
class ShareGPTConfig:
    name: str = "sharegpt"
    path: str | None = None  # explicit pairs file; None = resolve via workloads.data
    num_requests: int = setting(1000, min=1)
    arrival: str = setting("poisson", choices=ARRIVAL_PROCESSES)
    rate: float | None = setting(4.0, min=MIN_RATE, max=MAX_RATE)  # req/s; required > 0 unless offline (ignored then)
    cv: float = 1.0  # gamma only: coefficient of variation of the gaps
    tokenizer: str = setting("llama3", choices=tuple(TOKENIZERS))  # which token counts to use
    min_input_len: int = 1
    max_input_len: int | None = None
    min_output_len: int = 1
    max_output_len: int | None = None
    # prompt + output; e.g. 4096 keeps pairs inside Llama-2's context (one ShareGPT pair has a
    # 22,267-token output that alone sets the length of an offline run when left in)
    max_total_len: int | None = setting(None, min=2)
    seed: int = setting(0, min=0)  # the run config's default is ${seed} (testbed/config/composer.py)

    def __post_init__(self) -> None:
        check_types(self)
        check_arrival(self.arrival, self.rate, self.cv)
        check_range("min_input_len", self.min_input_len, "max_input_len", self.max_input_len)
        check_range("min_output_len", self.min_output_len, "max_output_len", self.max_output_len)


@dataclass(frozen=True)
class Pairs:
    """The pairs file as columns (read-only arrays; texts as a tuple)."""

    prompts: tuple[str, ...]
    counts: dict[str, np.ndarray]


@functools.lru_cache(maxsize=2)
def _load_pairs(path: str, mtime_ns: int, size: int) -> Pairs:
    """Every non-blank line must be a JSON object with a string `prompt` and whole-number token
    counts; anything else is an error naming the file, the line and the value (never skipped,
    never truncated)."""
    prompts: list[str] = []
    cols: dict[str, list[int]] = {f: [] for f in FIELDS[2:]}
    lineno = 0
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                rec = _record(path, lineno, line)
                prompts.append(rec["prompt"])
                for f in cols:
                    cols[f].append(rec[f])
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:  # bad gzip, truncated file, not UTF-8
        after = f" after line {lineno}" if lineno else ""
        raise TestbedError(f"cannot read ShareGPT pairs {path}{after}: {_one_line(exc)}") from exc
    counts = {f: np.asarray(v, dtype=np.int64) for f, v in cols.items()}
    for a in counts.values():
        a.setflags(write=False)
    return Pairs(tuple(prompts), counts)


def _record(path: str, lineno: int, line: str) -> dict:
    where = f"ShareGPT pairs {path} line {lineno}"
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested too deep
        raise TestbedError(f"{where}: not JSON ({_one_line(exc)})") from None
    if not isinstance(rec, dict):
        raise TestbedError(f"{where}: expected a JSON object with fields {', '.join(FIELDS)}, got {line.strip()[:80]!r}")
    missing = [f for f in FIELDS if f not in rec]
    if missing:
        raise TestbedError(f"{where}: missing field(s) {', '.join(missing)}")
    if not isinstance(rec["prompt"], str):
        raise TestbedError(f"{where}: invalid prompt={rec['prompt']!r}: must be a string")
    for f in FIELDS[2:]:
        v = rec[f]
        ok = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
        if not ok or not 0 <= v <= MAX_TOKENS:
            raise TestbedError(f"{where}: invalid {f}={v!r}: must be a whole number in [0, {MAX_TOKENS}]")
        rec[f] = int(v)
    return rec


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_pairs(path: Path) -> Pairs:
    st = path.stat()
    return _load_pairs(str(path), st.st_mtime_ns, st.st_size)


def build_sharegpt(cfg: ShareGPTConfig, data_dir: str | None = None) -> list[Request]:
    path = resolve_data_file(SHAREGPT_PAIRS, cfg.path, data_dir)
    pairs = load_pairs(path)
    in_col, out_col, extra = TOKENIZERS[cfg.tokenizer]
    inp = pairs.counts[in_col] + extra
    out = pairs.counts[out_col]

    ok = (inp >= cfg.min_input_len) & (out >= cfg.min_output_len)
    if cfg.max_input_len is not None:
        ok &= inp <= cfg.max_input_len
    if cfg.max_output_len is not None:
        ok &= out <= cfg.max_output_len
    if cfg.max_total_len is not None:
        ok &= inp + out <= cfg.max_total_len
    pool = np.flatnonzero(ok)
    if cfg.num_requests > len(pool):
        raise bad_value(key("num_requests"), cfg.num_requests,
                        f"only {len(pool)} of the {len(inp)} pairs in {path.name} pass the length filters; "
                        f"sampling is without replacement")

    sample_rng, arrival_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(2))
    chosen = sample_rng.choice(pool, size=cfg.num_requests, replace=False)
    arrivals = arrival_times(cfg.arrival, cfg.num_requests, arrival_rng, cfg.rate, cfg.cv)
    return make_requests(arrivals, inp[chosen], out[chosen], [pairs.prompts[i] for i in chosen])


WORKLOADS.add("sharegpt", WorkloadSpec(ShareGPTConfig, build_sharegpt))
