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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import TestbedError, bad_value
from engine.request import Request
from workloads.arrivals import arrival_times, check_arrival
from workloads.base import WORKLOADS, WorkloadSpec, check_choice, check_min, check_range, check_types, key, make_requests
from workloads.data import SHAREGPT_PAIRS, resolve_data_file

TOKENIZERS = {"llama3": ("input_tokens", "output_tokens", 1), "qwen3": ("input_tokens_qwen3", "output_tokens_qwen3", 0)}
FIELDS = ("id", "prompt", "input_tokens", "output_tokens", "input_tokens_qwen3", "output_tokens_qwen3")


@dataclass(frozen=True)
class ShareGPTConfig:
    name: str = "sharegpt"
    path: str | None = None  # explicit pairs file; None = resolve via workloads.data
    num_requests: int = 1000
    arrival: str = "poisson"  # offline | poisson | gamma
    rate: float | None = 4.0  # req/s; required > 0 unless offline (ignored then)
    cv: float = 1.0  # gamma only: coefficient of variation of the gaps
    tokenizer: str = "llama3"  # llama3 | qwen3: which token counts to use
    min_input_len: int = 1
    max_input_len: int | None = None
    min_output_len: int = 1
    max_output_len: int | None = None
    # prompt + output; e.g. 4096 keeps pairs inside Llama-2's context (one ShareGPT pair has a
    # 22,267-token output that alone sets the length of an offline run when left in)
    max_total_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        check_min("num_requests", self.num_requests, 1)
        check_min("max_total_len", self.max_total_len, 2)
        check_arrival(self.arrival, self.rate, self.cv)
        check_choice("tokenizer", self.tokenizer, tuple(TOKENIZERS))
        check_range("min_input_len", self.min_input_len, "max_input_len", self.max_input_len)
        check_range("min_output_len", self.min_output_len, "max_output_len", self.max_output_len)


@dataclass(frozen=True)
class Pairs:
    """The pairs file as columns (read-only arrays; texts as a tuple)."""

    prompts: tuple[str, ...]
    counts: dict[str, np.ndarray]


@functools.lru_cache(maxsize=2)
def _load_pairs(path: str, mtime_ns: int, size: int) -> Pairs:
    prompts: list[str] = []
    cols: dict[str, list[int]] = {f: [] for f in FIELDS[2:]}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                missing = [f for f in FIELDS if f not in rec]
                if missing:
                    raise TestbedError(f"{path} line {lineno}: missing field(s) {', '.join(missing)}")
                prompts.append(rec["prompt"])
                for f in cols:
                    cols[f].append(int(rec[f]))
    except (OSError, EOFError, ValueError) as exc:  # bad gzip, truncated file, bad JSON
        raise TestbedError(f"cannot read ShareGPT pairs {path}: {exc}") from exc
    counts = {f: np.asarray(v, dtype=np.int64) for f, v in cols.items()}
    for a in counts.values():
        a.setflags(write=False)
    return Pairs(tuple(prompts), counts)


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
