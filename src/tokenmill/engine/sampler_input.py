"""What the sampler needs for an ordinary step's rows, taken from the scheduled batch: each row's
parameters, generator, penalty window, output count, stop ids and grammar mask."""
from __future__ import annotations

from tokenmill.engine.batch import ScheduledBatch, ScheduledChunk
from tokenmill.engine.sampler import SamplerInput
from tokenmill.engine.speculative import row_generators
from tokenmill.structured import PendingMasks


def recent_ids(chunk: ScheduledChunk, row: int) -> list[int]:
    """The penalty window of a chunk's sampled row: the context, then the proposals before the row."""
    seq = chunk.seq
    n = seq.params.repeat_last_n
    if not row or n == 0:
        return seq.last_token_ids(n)
    window = seq.last_token_ids(n) + chunk.draft_ids[:row]
    return window[-n:] if n > 0 else window


def sampler_input(batch: ScheduledBatch, stop_ids: frozenset[int], masks: PendingMasks | None = None) -> SamplerInput:
    """One row per sampled row: a speculating sequence has one for its last token and one for each
    proposal, each sampled as the step that reached it without speculation would (its penalty window
    and output count include the proposals before it; speculative/verify.py). A sequence with a
    generator that verifies proposals gets one generator per row (chunk.row_generators), which the
    scheduler settles once it knows how many were accepted."""
    chunks = batch.sampling_chunks
    rows = [(c, j) for c in chunks for j in range(c.num_sample_rows)]
    params = [c.seq.params for c, _ in rows]
    recent = [recent_ids(c, j) for c, j in rows] if any(p.uses_penalties for p in params) else []
    generators: list = []
    for c in chunks:
        if c.draft_ids and c.seq.generator is not None:
            c.row_generators = row_generators(c.seq.generator, c.num_sample_rows)
            generators += c.row_generators
        else:
            generators += [c.seq.generator] * c.num_sample_rows
    return SamplerInput(
        params=params,
        generators=generators,
        recent_token_ids=recent,
        num_output_tokens=[len(c.seq.output_ids) + j for c, j in rows],
        stop_token_ids=[stop_ids] * len(rows),
        # A forked sample has its parent's grammar state, hence its parent's mask; a proposed row
        # the state after the proposals before it.
        token_masks=None if masks is None else masks.for_rows([key for c in chunks for key in c.mask_keys()]),
    )
