"""What the cost model is asked about a micro-batch: its shape as O(1) aggregates (`BatchShape`),
built by the controller's batches (engine/core/batch.py), the profile tables and the fits."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What the cost model needs to know about a micro-batch, as O(1) aggregates.

    - num_prefill_tokens: tokens of all prefill chunks.
    - num_decode_seqs: decode sequences (one token each).
    - decode_context_sum: sum over decodes of the KV tokens attended, the new token included.
    - prefill_attention_pairs: sum over chunks of x*L + x*(x+1)/2 (causal query-key pairs of a
      chunk of x tokens after a prefix of L).
    - prefill_context_sum: sum over chunks of L + x (KV tokens read).
    - num_sampled: sequences sampling a token (decodes + chunks that end their prompt).
    - num_seqs: prefill chunks + decodes.
    - decode_context_max: the longest decode's context (0: not known, e.g. a designed shape built
      from a sum): an engine that pads every decode to the longest one reads D x this
      (`CostCoefficients.decode_padding`).
    """

    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    decode_context_sum: int = 0
    prefill_attention_pairs: int = 0
    prefill_context_sum: int = 0
    num_sampled: int = 0
    num_seqs: int = 0
    decode_context_max: int = 0

    def __post_init__(self) -> None:
        if (
            min(self.num_prefill_tokens, self.num_decode_seqs, self.num_sampled) < 0
            or self.decode_context_sum < self.num_decode_seqs
            or self.prefill_context_sum < self.num_prefill_tokens
            or self.prefill_attention_pairs < self.num_prefill_tokens
            or self.num_sampled > self.num_seqs
            or self.num_decode_seqs + (self.num_prefill_tokens > 0) > self.num_seqs
            or (self.decode_context_max and self.decode_context_max * self.num_decode_seqs < self.decode_context_sum)
        ):
            raise ValueError(f"inconsistent {self!r}")

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @classmethod
    def from_parts(
        cls,
        prefills: Iterable[tuple[int, int, bool]] = (),
        decode_contexts: Iterable[int] = (),
    ) -> BatchShape:
        """Aggregate prefill chunks `(prefix_len, chunk_len, samples)` and decode context lengths
        (KV tokens attended including the new token, so >= 1)."""
        tokens = pairs = context = sampled = seqs = 0
        for prefix, chunk, samples in prefills:
            if prefix < 0 or chunk < 1:
                raise ValueError(f"bad prefill chunk: prefix_len={prefix}, chunk_len={chunk}")
            tokens += chunk
            pairs += chunk * prefix + chunk * (chunk + 1) // 2
            context += prefix + chunk
            seqs += 1
            if samples:
                sampled += 1
        decodes = decode_sum = decode_max = 0
        for ctx in decode_contexts:
            if ctx < 1:
                raise ValueError(f"bad decode context length {ctx}: must be >= 1 (it includes the new token)")
            decodes += 1
            decode_sum += ctx
            decode_max = max(decode_max, ctx)
        return cls(tokens, decodes, decode_sum, pairs, context, sampled + decodes, seqs + decodes, decode_max)

    @classmethod
    def decode(cls, batch_size: int, context_len: int) -> BatchShape:
        """`batch_size` decodes, each attending `context_len` tokens (the new one included)."""
        if batch_size < 0 or context_len < 1:
            raise ValueError(f"bad decode batch: batch_size={batch_size}, context_len={context_len}")
        return cls(0, batch_size, batch_size * context_len, 0, 0, batch_size, batch_size,
                   context_len if batch_size else 0)

    @classmethod
    def prefill(cls, chunk_len: int, prefix_len: int = 0, samples: bool = True) -> BatchShape:
        """One prefill chunk."""
        return cls.from_parts([(prefix_len, chunk_len, samples)])

    def __add__(self, other: BatchShape) -> BatchShape:
        if not isinstance(other, BatchShape):
            return NotImplemented
        return BatchShape(
            self.num_prefill_tokens + other.num_prefill_tokens,
            self.num_decode_seqs + other.num_decode_seqs,
            self.decode_context_sum + other.decode_context_sum,
            self.prefill_attention_pairs + other.prefill_attention_pairs,
            self.prefill_context_sum + other.prefill_context_sum,
            self.num_sampled + other.num_sampled,
            self.num_seqs + other.num_seqs,
            max(self.decode_context_max, other.decode_context_max),
        )
