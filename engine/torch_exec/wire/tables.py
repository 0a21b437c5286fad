"""Block tables sent as deltas: the driver remembers what the stages hold, the stages keep the tables.

A sequence's block table only grows while it lives (engine/core/kv.py: a decode adds one block every
`block_size` tokens) and is freed whole when it finishes or is preempted. So instead of every
table in every launch (a steady decode of 256 sequences at context 2,048 named 32,768 block ids
per launch), a launch row carries `(table_from, blocks)`: the blocks from index `table_from` on;
usually none for a decode. Both sides apply the changes in launch order, which every stage
receives the launches in, so the driver's record and each stage's tables agree:

- `DriverTables.delta(seq_id, table, reset)`: what the row sends; the whole table (`table_from`
  0) for a sequence the stages do not hold, a prefill from position 0 (a new or recomputed
  sequence) or a table whose known prefix changed (freed and allocated again in between).
- `DriverTables.released(live)`: the sequences the run no longer holds blocks for; the launch
  names them and the stages drop their tables (and the driver its prompt ids).
- `StageTables.resolve(launch)`: the launch with whole tables (`wire.PrefillChunk` /
  `wire.DecodeRow`, what `StageModel.prepare` reads), applied when the message arrives. Arrival
  is launch order, so a stage that runs micro-batches out of order (behind a paced link) or
  prepares one ahead still sees each table as its launch defined it: the micro-batches in flight
  hold disjoint sequences, and a sequence's next delta comes only after its micro-batch completed
  on every stage.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.core.batch import MicroBatch
import engine.torch_exec.wire.messages as wire


class DriverTables:
    """The driver's record of the tables the stages hold: per sequence, how many blocks, the first
    and the last (a table freed and allocated again in between almost surely differs in one)."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[int, int, int]] = {}

    def delta(self, seq_id: int, table: list[int], reset: bool = False) -> tuple[int, list[int]]:
        have = 0
        if not reset and seq_id in self.known:
            n, first, last = self.known[seq_id]
            if 0 < n <= len(table) and table[0] == first and table[n - 1] == last:
                have = n
        self.known[seq_id] = (len(table), table[0], table[-1]) if table else (0, -1, -1)
        return have, table[have:]

    def released(self, live: Callable[[int], bool]) -> list[int]:
        """Forget (and return) the sequences `live` says the run no longer holds."""
        gone = [s for s in self.known if not live(s)]
        for s in gone:
            del self.known[s]
        return gone


class LaunchRows:
    """The driver's rows of each launch: per prefill chunk its token ids (the prompt's, then the
    sequence's generated ids, so a recomputation after preemption re-feeds exactly what was there),
    per decode its last token, every block table as a delta; and the sequences released since the
    last launch (their prompt ids are dropped too)."""

    def __init__(self, vocab: int, prompt_seed: int) -> None:
        self.vocab, self.prompt_seed = vocab, prompt_seed
        self.tables = DriverTables()
        self.prompts: dict[int, list[int]] = {}

    def rows(self, mb: MicroBatch, table: Callable[[int], list[int]], live: Callable[[int], bool]
             ) -> tuple[list[wire.PrefillMeta], list[wire.DecodeMeta], list[int]]:
        released = self.tables.released(live)
        for seq_id in released:
            self.prompts.pop(seq_id, None)
        delta = self.tables.delta
        prefills = []
        for c in mb.prefills:
            seq = c.seq
            prompt = self.prompt(seq.request)
            end = c.start + c.num_tokens
            toks = prompt[c.start:end] if end <= len(prompt) else (prompt + seq.output_token_ids)[c.start:end]
            prefills.append(wire.PrefillMeta(seq.seq_id, c.start, c.num_tokens, bool(c.samples),
                                             *delta(seq.seq_id, table(seq.seq_id), c.start == 0), toks))
        decodes = []
        for seq in mb.decodes:
            pos = seq.num_computed
            prompt = self.prompt(seq.request)
            tok = prompt[pos] if pos < len(prompt) else seq.output_token_ids[pos - len(prompt)]
            decodes.append(wire.DecodeMeta(seq.seq_id, pos, *delta(seq.seq_id, table(seq.seq_id)), tok))
        return prefills, decodes, released

    def prompt(self, request) -> list[int]:
        ids = self.prompts.get(request.request_id)
        if ids is None:
            from engine.torch_exec.weights.checkpoint import prompt_ids

            ids = self.prompts[request.request_id] = prompt_ids(request, self.vocab, self.prompt_seed)
        return ids


@dataclass(frozen=True)
class StageLaunch:
    """A `wire.Launch` with whole block tables: what a stage runs."""

    mb_id: int
    kind: str
    prefills: list[wire.PrefillChunk]
    decodes: list[wire.DecodeRow]
    sampling: list[wire.RequestSampling]


class StageTables:
    """A stage's block tables by sequence, kept up to date by each launch's deltas."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def resolve(self, msg: wire.Launch) -> StageLaunch:
        for s in msg.released:
            self.tables.pop(s, None)
        table = self.table
        prefills = [wire.PrefillChunk(p.seq_id, p.start, p.num_tokens, p.samples,
                                      table(p.seq_id, p.table_from, p.blocks), p.token_ids) for p in msg.prefills]
        decodes = [wire.DecodeRow(d.seq_id, d.position, table(d.seq_id, d.table_from, d.blocks), d.token_id)
                   for d in msg.decodes]
        return StageLaunch(msg.mb_id, msg.kind, prefills, decodes, msg.sampling)

    def table(self, seq_id: int, table_from: int, blocks: list[int]) -> list[int]:
        if table_from == 0:
            t = self.tables[seq_id] = blocks
            return t
        t = self.tables.get(seq_id)
        if t is None or len(t) != table_from:
            held = "none" if t is None else f"{len(t)} blocks"
            raise RuntimeError(f"sequence {seq_id}: a block-table delta from index {table_from}, but this stage "
                               f"holds {held} for it (the driver's and the stage's tables disagree)")
        t.extend(blocks)
        return t
