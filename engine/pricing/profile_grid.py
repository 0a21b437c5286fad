"""The designed micro-batches of a profile (`testbed profile --grid NAME`), torch-free.

A grid is the product of its axes, filtered by two caps; each point is a tuple
`(kind, batch, tokens, prefix, context)` in the profile table's columns (testbed/calibrate/fit.py):

- prefill: `batch` prompts, each a chunk of `tokens` after `prefix` cached tokens
  (batch x tokens <= `max_batch_tokens`);
- decode: `batch` decodes each attending `context` tokens (batch x context <= `max_kv_tokens`
  when that cap is set: the KV pool must hold them);
- mixed: one prefill chunk of `tokens` (no prefix) riding with `batch` decodes at `context`
  (what chunked-prefill schedulers such as Sarathi and vLLM's default scheduler produce).

Grids (`GRIDS`): `quick` and `default` are the CPU grids `testbed profile` has always used
(about 10 s and a few minutes on a 2-core host with tiny-llama); `serving` covers what serving
on a GPU produces (decode batch 1-256 x context 64-4,096, prefill 16-4,096 tokens with and without
a prefix, mixed batches; 78 points); `serving-cpu` is the same design at a CPU-sized scale.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from engine.base.errors import ConfigError, unknown_choice

__all__ = ["ProfileGrid", "GRIDS", "get_grid", "design", "max_context", "Point"]

Point = tuple[str, int, int, int, int]  # (kind, batch, tokens, prefix, context)


@dataclass(frozen=True)
class ProfileGrid:
    name: str
    prefill_tokens: tuple[int, ...]
    prefill_batch: tuple[int, ...]
    prefill_prefix: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    mixed: tuple[tuple[int, int, int], ...] = ()  # (decodes, decode context, chunk tokens)
    max_batch_tokens: int = 2048  # prefill rows: batch x tokens at most
    max_kv_tokens: int = 0  # decode rows: batch x context at most (0: no cap)

    @classmethod
    def from_mapping(cls, grid: Mapping[str, Sequence] | ProfileGrid) -> ProfileGrid:
        """A grid from the plain dict form (`{"prefill_tokens": (...), ...}`) tests and callers use."""
        if isinstance(grid, ProfileGrid):
            return grid
        known = {f.name for f in fields(cls)}
        bad = sorted(set(grid) - known)
        if bad:
            raise ConfigError(f"unknown profile grid keys {', '.join(bad)}; valid: {', '.join(sorted(known))}")
        kw = {k: (tuple(tuple(p) for p in v) if k == "mixed" else tuple(v)) if isinstance(v, (list, tuple)) else v
              for k, v in grid.items()}
        kw.setdefault("name", "custom")
        return cls(**kw)

    def points(self) -> list[Point]:
        out: list[Point] = []
        for b in self.prefill_batch:
            for x in self.prefill_tokens:
                for L in self.prefill_prefix:
                    if b * x <= self.max_batch_tokens:
                        out.append(("prefill", b, x, L, 0))
        for b in self.decode_batch:
            for c in self.decode_context:
                if not self.max_kv_tokens or b * c <= self.max_kv_tokens:
                    out.append(("decode", b, 0, 0, c))
        for b, c, x in self.mixed:
            out.append(("mixed", b, x, 0, c))
        return out

    def max_context(self) -> int:
        ctx = [max(self.decode_context, default=1)]
        if self.prefill_tokens:
            ctx.append(max(self.prefill_tokens) + max(self.prefill_prefix, default=0))
        ctx += [max(c, x) for _, c, x in self.mixed]
        return max(ctx)

    def max_decodes(self) -> int:
        return max([*self.decode_batch, *(b for b, _, _ in self.mixed), 1])

    def max_prefills(self) -> int:
        return max([*self.prefill_batch, 1])


def design(grid: Mapping[str, Sequence] | ProfileGrid) -> list[Point]:
    """(kind, batch, tokens, prefix, context) of every designed batch."""
    return ProfileGrid.from_mapping(grid).points()


def max_context(grid: Mapping[str, Sequence] | ProfileGrid) -> int:
    return ProfileGrid.from_mapping(grid).max_context()


GRIDS: dict[str, ProfileGrid] = {g.name: g for g in (
    ProfileGrid("quick", prefill_tokens=(16, 128, 384), prefill_batch=(1,), prefill_prefix=(0, 256),
                decode_batch=(1, 16, 64), decode_context=(32, 512)),
    ProfileGrid("default", prefill_tokens=(8, 32, 128, 256, 512), prefill_batch=(1, 4), prefill_prefix=(0, 512),
                decode_batch=(1, 4, 16, 64, 128), decode_context=(16, 256, 1024)),
    ProfileGrid("serving", prefill_tokens=(16, 64, 256, 1024, 2048, 4096), prefill_batch=(1, 4),
                prefill_prefix=(0, 1024), decode_batch=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                decode_context=(64, 256, 1024, 2048, 4096),
                mixed=tuple((b, c, x) for b in (8, 64, 192) for c in (512, 2048) for x in (256, 2048)),
                max_batch_tokens=8192, max_kv_tokens=2 ** 19),
    ProfileGrid("serving-cpu", prefill_tokens=(8, 32, 128, 512), prefill_batch=(1, 4), prefill_prefix=(0, 256),
                decode_batch=(1, 4, 16, 64), decode_context=(16, 128, 512, 1024),
                mixed=((4, 256, 64), (16, 512, 128), (32, 128, 256)), max_batch_tokens=1024,
                max_kv_tokens=2 ** 15),
)}


def get_grid(name: str) -> ProfileGrid:
    try:
        return GRIDS[name]
    except (KeyError, TypeError):
        raise unknown_choice("profile grid", name, GRIDS) from None
