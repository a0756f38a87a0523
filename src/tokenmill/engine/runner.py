"""Turns a scheduled batch into flat tensors and runs the model on it, in micro-batches of at most
`n_ubatch` tokens. Only rows that sample get logits; the prompt rows of a request that asks for its
prompt's logprobs come back as hidden states, for engine/prompt_scores.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.request import Sequence
from tokenmill.engine.scheduler import ScheduledBatch, ScheduledChunk
from tokenmill.kernels.argmax import argmax_rows, excluding
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import AttentionMetadata, ChunkSpec
from tokenmill.model.decode_graph import DecodeGraph
from tokenmill.model.host_tensors import host_tensor
from tokenmill.model.paged_batch import PagedBatch
from tokenmill.model.step_graph import StepGraph


def split_ubatches(chunks: list[ScheduledChunk], n_ubatch: int) -> list[list[tuple[ScheduledChunk, int, int]]]:
    """Cut the step's chunks into micro-batches of <= n_ubatch tokens, splitting long prefill chunks.
    Items are (chunk, start, num_new); later pieces of a chunk see earlier ones through the cache."""
    ubatches: list[list[tuple[ScheduledChunk, int, int]]] = [[]]
    room = n_ubatch
    for chunk in chunks:
        start, left = chunk.start, chunk.num_new
        while left:
            if room == 0:
                ubatches.append([])
                room = n_ubatch
            take = min(left, room)
            ubatches[-1].append((chunk, start, take))
            start, left, room = start + take, left - take, room - take
    return [u for u in ubatches if u]


@dataclass
class PromptRows:
    """The last layer's hidden states (before the final norm) at prompt positions [first, first + rows)
    of seq: their logits score prompt tokens first + 1 onwards."""
    seq: Sequence
    first: int
    hidden: torch.Tensor


@dataclass
class StepOutput:
    logits: torch.Tensor | None  # [sampled rows, vocab] in batch order; None if nobody samples
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # run(greedy_tokens=True): each sampled row's greedy token (int64, batch order) in place of logits.
    tokens: torch.Tensor | None = None


def scored_positions(seq: Sequence, start: int, num_new: int) -> range:
    """The positions of a chunk piece whose rows score the prompt's next token: not yet scored (a
    recompute after preemption goes over them again) and followed by a prompt token."""
    if not seq.wants_prompt_scores:
        return range(0)
    return range(max(start, len(seq.prompt_scores)), min(start + num_new, len(seq.prompt_ids) - 1))


@dataclass
class UbatchInputs:
    """What one micro-batch hands the model, whatever device runs it: the rows' token ids and
    positions, each piece's block table, the rows that get logits, and the prompt rows to score."""
    ids: list[int]
    positions: list[int]
    specs: list[ChunkSpec]
    sample_rows: list[int]
    scored: list[tuple[Sequence, range, int]]  # (seq, positions, row of the first)

    @classmethod
    def build(cls, ubatch: list[tuple[ScheduledChunk, int, int]], blocks: BlockManager) -> "UbatchInputs":
        out = cls([], [], [], [], [])
        for chunk, start, num_new in ubatch:
            seq = chunk.seq
            if chunk.num_new == 1 and not chunk.draft_ids and not seq.wants_prompt_scores:
                # A decode row (most rows of most steps): its one input id, sampled when the chunk samples.
                if chunk.samples:
                    out.sample_rows.append(len(out.ids))
                out.ids.extend(seq.token_ids_between(start, start + 1))
                out.positions.append(start)
                out.specs.append(ChunkSpec(blocks.block_table(seq.seq_id), start, 1))
                continue
            scored_here = scored_positions(chunk.seq, start, num_new)
            if scored_here:
                out.scored.append((chunk.seq, scored_here, len(out.ids) + scored_here.start - start))
            # A speculating sequence's proposals are rows like any others, each sampled.
            out.sample_rows.extend(len(out.ids) + r for r in chunk.sample_rows_in(start, num_new))
            out.ids.extend(chunk.input_ids(start, num_new))
            out.positions.extend(range(start, start + num_new))
            out.specs.append(ChunkSpec(blocks.block_table(chunk.seq.seq_id), start, num_new))
        return out

    def __iter__(self):
        return iter((self.ids, self.positions, self.specs, self.sample_rows, self.scored))


class ModelRunner:
    supports_drafts = True  # computes and returns logits for every proposed row (ScheduledChunk.draft_ids)
    picks_greedy_tokens = True  # run(greedy_tokens=True): tokens instead of logits

    def __init__(self, model: torch.nn.Module, kv: KVStorage, blocks: BlockManager, n_ubatch: int,
                 decode_graph: DecodeGraph | None = None, step_graph: StepGraph | None = None, *,
                 native_attention: bool = False):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.n_ubatch = n_ubatch
        self.decode_graph = decode_graph
        self.step_graph = step_graph
        self.native_attention = native_attention  # every row through kernels/attention.py (PagedBatch)
        self.graph_steps = 0  # micro-batches that ran through the compiled decode graph
        self.step_graph_steps = 0  # ... and through the compiled prefill/mixed graph

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, greedy_tokens: bool = False, exclude: tuple[int, ...] = ()) -> StepOutput:
        """Logits of the sampling rows (the model's dtype), and the hidden states of prompt rows to score.
        greedy_tokens: every sampling row takes its logits' argmax and nothing else (the engine checked),
        so the rows' tokens come back instead, from DecoderLM.greedy_tokens (most of the head skipped);
        exclude: the ids every such row suppresses (its end tokens under ignore_eos), never its token."""
        if greedy_tokens:
            tokens, prompt_rows = self._run(batch, lambda hidden, rows: self.model.greedy_tokens(hidden, rows, exclude),
                                            lambda logits: argmax_rows(excluding(logits.float(), exclude)))
            return StepOutput(None, prompt_rows, tokens)
        return StepOutput(*self._run(batch, self.model.logits, lambda logits: logits))

    def _run(self, batch: ScheduledBatch, head, from_logits) -> tuple[torch.Tensor | None, list[PromptRows]]:
        """The model over the batch's micro-batches: head(hidden, rows) of the sampling rows (or
        from_logits(logits) where the compiled decode graph made logits) joined in batch order (None
        when no row samples), and the prompt rows to score."""
        outputs: list[torch.Tensor] = []
        prompt_rows: list[PromptRows] = []
        for ubatch in split_ubatches(batch.chunks, self.n_ubatch):
            ids, positions, specs, sample_rows, scored = UbatchInputs.build(ubatch, self.blocks)
            graph_logits = None if scored else self._run_graph(ids, positions, specs, sample_rows)
            if graph_logits is not None:
                outputs.append(from_logits(graph_logits))
                continue
            meta = self.attention_meta(specs)
            if self.step_graph is not None and self.step_graph.accepts(len(ids)):
                self.step_graph_steps += 1
                hidden = self.step_graph(host_tensor(ids, torch.int64), host_tensor(positions, torch.int64), meta)
            else:
                hidden = self.model(host_tensor(ids, torch.int64), host_tensor(positions, torch.int64), meta, self.kv)
            if sample_rows:
                outputs.append(head(hidden, host_tensor(sample_rows, torch.int64)))
            for seq, where, row in scored:
                prompt_rows.append(PromptRows(seq, where.start, hidden[row:row + len(where)].clone()))
        if not outputs:
            return None, prompt_rows
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), prompt_rows

    def hidden_states(self, ids: list[int], start: int, block_table) -> torch.Tensor:
        """One sequence's chunk at positions start.. run eagerly (embeddings): its last layer's hidden
        states, its K/V written to the cache."""
        meta = self.attention_meta([ChunkSpec(block_table, start, len(ids))])
        return self.model(torch.tensor(ids), torch.arange(start, start + len(ids)), meta, self.kv)

    def attention_meta(self, specs: list[ChunkSpec]) -> AttentionMetadata | PagedBatch:
        if self.native_attention:
            return PagedBatch.build(specs, self.kv.block_size)
        return AttentionMetadata.build(specs, self.kv.block_size)

    def _run_graph(self, ids: list[int], positions: list[int], specs: list[ChunkSpec],
                   sample_rows: list[int]) -> torch.Tensor | None:
        """Decode-only micro-batches where every row samples go through the compiled graph;
        None when this one does not (the caller runs it eagerly)."""
        g = self.decode_graph
        if g is None or not g.ready or len(sample_rows) != len(specs) or any(s.num_new != 1 for s in specs):
            return None
        bs = self.kv.block_size
        lens = [s.num_cached + 1 for s in specs]
        used = [-(-n // bs) for n in lens]
        if not g.accepts(len(specs), max(used)):
            return None
        width = g.padded_width(max(used))
        tables = [list(s.block_table[:u]) for s, u in zip(specs, used)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        block_ids = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.graph_steps += 1
        return g(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), block_ids, torch.tensor(lens))
