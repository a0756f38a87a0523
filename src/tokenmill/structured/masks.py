"""Token masks for the constrained rows of a sampling step.

The engine starts computing them (`MaskWorker.start`) as soon as the batch is scheduled, on a worker
thread, so they are built while the model runs (llguidance drops the GIL); the sampler then only
unpacks the bits and fills -inf. Rows without a constraint never appear here and pay nothing."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tokenmill.kernels.token_mask import apply_token_bitmask, unpack_allowed
from tokenmill.structured.constraint import Constraint


@dataclass
class TokenMasks:
    """Allowed tokens for some rows of a [rows, vocab] logits tensor: bits[j] is for row rows[j],
    bit t of the little-endian int32 words set when token id t is allowed."""
    rows: list[int]
    bits: torch.Tensor  # int32 [len(rows), words]

    def allowed(self, vocab: int) -> torch.Tensor:
        """bool [len(rows), vocab]; ids past the mask (padding rows of the embedding) are never allowed."""
        return unpack_allowed(self.bits, vocab)


def compute_masks(constraints: list[Constraint]) -> torch.Tensor:
    """One bitmask row per constraint (int32 [n, words])."""
    words = max(c.num_mask_words for c in constraints)
    bits = torch.zeros((len(constraints), words), dtype=torch.int32)
    for i, c in enumerate(constraints):
        c.fill_mask(bits[i, :c.num_mask_words])
    return bits


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks, *, in_place: bool) -> torch.Tensor:
    """Disallowed tokens of the masked rows go to -inf."""
    out = logits if in_place else logits.clone()
    apply_token_bitmask(out, masks.rows, masks.bits)
    return out


class PendingMasks:
    """Masks being computed for some sequences (keyed by seq id) while the model runs."""

    def __init__(self, seq_ids: list[int], future: Future):
        self._index = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        self._future = future

    def wait(self) -> None:
        """Block until the worker is done with the matchers (it reads them while it computes)."""
        self._future.result()

    def for_rows(self, row_seq_ids: list[int | None]) -> TokenMasks | None:
        """The masks for the sampler's rows, given which sequence's mask each row takes (None: no
        constraint). Waits for the worker."""
        bits = self._future.result()
        rows = [r for r, s in enumerate(row_seq_ids) if s is not None and s in self._index]
        if not rows:
            return None
        return TokenMasks(rows, bits[[self._index[row_seq_ids[r]] for r in rows]])


class MaskWorker:
    """The one thread that computes masks; one at a time, so a sequence's matcher is never read
    while the engine thread advances it (the engine waits for the step's masks before it does)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, constrained: list[tuple[int, Constraint]]) -> PendingMasks | None:
        """(seq id, constraint) of the rows that will sample; None when there are none."""
        if not constrained:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-masks")
        constraints = [c for _, c in constrained]
        return PendingMasks([s for s, _ in constrained], self._pool.submit(compute_masks, constraints))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
