"""Draft-model proposals (`--speculative draft:MODEL`): a smaller model with the same vocabulary decodes
k tokens greedily after a sequence's context, and the target verifies them in its next step like any
proposals (verify.py: a greedy draft puts all its mass on one token, so the rejection rule there holds
unchanged, and greedy output stays the target's own).

The draft keeps its own KV cache: its layers, heads and head size differ from the target's, so its K/V
cannot live in the target's blocks. It gets its own KVStorage and BlockManager (no prefix caching),
with as many token slots as the target's cache, allocated lazily like the target's. Each speculating
sequence owns a table there that follows its context: after a verification, the draft's tokens past
the part the target agreed with are overwritten by the target's, so a step recomputes only those and
the token the target added, then decodes k - 1 more. When the draft's cache is full the sequence
simply proposes nothing that step: a draft never preempts anyone or fails a request."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.engine.speculative.config import SpecConfig
from tokenmill.engine.speculative.policy import AcceptanceRate, StepCosts, best_num_tokens
from tokenmill.engine.speculative.proposer import BackOff, step_cost
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import ChunkSpec
from tokenmill.model.paged_batch import PagedBatch

log = logging.getLogger(__name__)


class DraftModel:
    """The draft's weights and its own paged KV cache; greedy decoding for one sequence at a time."""

    def __init__(self, model: torch.nn.Module, kv: KVStorage, n_ubatch: int, context_length: int,
                 weight_bytes: int = 0):
        self.model = model
        self.kv = kv
        self.weight_bytes = weight_bytes
        self.blocks = BlockManager(kv.num_blocks, kv.block_size, enable_prefix_caching=False)
        self.n_ubatch = n_ubatch
        self.max_len = min(context_length, kv.num_blocks * kv.block_size)

    @torch.inference_mode()
    def generate(self, key: int, keep: int, token_ids: Sequence[int], k: int) -> list[int]:
        """k greedy tokens after token_ids for the table `key`, whose first `keep` cached tokens are
        token_ids' own; [] when its cache has no room (nothing then changes but a trimmed tail)."""
        n_ids = len(token_ids)
        total = n_ids + k - 1  # the context, and the proposals but the last fed back
        keep = min(keep, n_ids - 1)  # the last token is always run again: its row gives the first proposal
        if k < 1 or total > self.max_len:
            return []
        self.blocks.trim(key, keep)
        if not self.blocks.can_allocate(key, total):
            return []
        self.blocks.allocate(key, total)
        table = self.blocks.block_table(key)
        for start in range(keep, n_ids, self.n_ubatch):
            hidden = self._forward(token_ids[start:start + self.n_ubatch], start, table)
        out = [self._argmax(hidden)]
        for i in range(k - 1):
            out.append(self._argmax(self._forward([out[-1]], n_ids + i, table)))
        return out

    def release(self, key: int) -> None:
        self.blocks.free(key)

    @property
    def nbytes(self) -> int:
        """Its weights and its whole KV cache (allocated as used, like the target's)."""
        return self.weight_bytes + self.kv.nbytes

    def _forward(self, ids: Sequence[int], start: int, table: list[int]) -> torch.Tensor:
        meta = PagedBatch.build([ChunkSpec(table, start, len(ids))], self.kv.block_size)
        return self.model(torch.tensor(list(ids)), torch.arange(start, start + len(ids)), meta, self.kv)

    def _argmax(self, hidden: torch.Tensor) -> int:
        logits = self.model.logits(hidden, torch.tensor([hidden.shape[0] - 1]))
        return int(torch.argmax(logits[0]))


@dataclass
class DraftState:
    key: int                 # the sequence's table in the draft's cache
    num_shifted_tokens: int  # the sequence's at creation: a context shift rewrites the context
    rate: AcceptanceRate
    backoff: BackOff
    cached: list[int] = field(default_factory=list)  # the tokens whose K/V the draft holds, from position 0
    known: int = 0           # how many of them were the sequence's own context (the rest were guesses)
    match_len: int = 0       # prompt lookup's; a draft has no match (read by nobody here)


class DraftProposer:
    """Draft-model proposals for the sequences of one engine, with the n-gram proposer's back-off."""

    def __init__(self, cfg: SpecConfig, draft: DraftModel, draft_cost: float, costs: StepCosts | None = None):
        self.cfg = cfg
        self.costs = costs if costs is not None else StepCosts(cfg.row_cost)
        self.draft = draft
        self.draft_cost = draft_cost  # one draft step, as a share of a one-row target step
        self._keys = itertools.count()
        self.num_failures = 0  # draft steps that raised (logged)

    def new_state(self, num_shifted_tokens: int) -> DraftState:
        return DraftState(next(self._keys), num_shifted_tokens, AcceptanceRate(prior=self.cfg.prior_acceptance),
                          BackOff(next_cooldown=self.cfg.cooldown_steps))

    def propose(self, state: DraftState | None, token_ids: Sequence[int], num_shifted_tokens: int, cap: int,
                num_rows: int = 1) -> tuple[DraftState, list[int]]:
        if state is None or state.num_shifted_tokens != num_shifted_tokens:
            if state is not None:
                self.forget(state)
            state = self.new_state(num_shifted_tokens)
        k = 0
        if not state.backoff.cooling() and cap > 0:
            cost = step_cost(self.cfg, self.costs, len(token_ids), num_rows)
            k = best_num_tokens(state.rate.value, num_rows, cost, cap, self.draft_cost)
        draft = self._generate(state, token_ids, k) if k else []
        if draft:
            state.cached = [*token_ids, *draft[:-1]]
            state.known = len(token_ids)
        else:  # keep only what is still the context's (a failed generate may have trimmed past it)
            state.rate.idle()
            state.cached = state.cached[:min(_agreeing(state, token_ids), len(token_ids) - 1)]
            state.known = len(state.cached)
        return state, draft

    def _generate(self, state: DraftState, token_ids: Sequence[int], k: int) -> list[int]:
        """The draft's k tokens, or none when its step fails: proposals are optional, so a draft's error
        must not fail the target's requests (its table goes back, and the sequence starts over there)."""
        try:
            return self.draft.generate(state.key, _agreeing(state, token_ids), token_ids, k)
        except Exception:  # noqa: BLE001 - see above; logged in full the first time, counted after
            self.num_failures += 1
            if self.num_failures == 1:
                log.exception("the draft model's step failed; that sequence proposes nothing this step")
            else:
                log.warning("the draft model's step failed again (%d failures)", self.num_failures)
            self.forget(state)
            return []

    def observe(self, state: DraftState, num_draft_tokens: int, num_accepted: int) -> None:
        state.rate.observe(num_draft_tokens, num_accepted)
        state.backoff.observe(self.cfg, num_accepted)

    @property
    def nbytes(self) -> int:
        return self.draft.nbytes

    def forget(self, state: DraftState) -> None:
        """The sequence is done or starts over: its table in the draft's cache goes back."""
        self.draft.release(state.key)
        state.cached, state.known = [], 0


def _agreeing(state: DraftState, token_ids: Sequence[int]) -> int:
    """How many of the draft's cached tokens token_ids begins with. The sequence only grows between
    proposals (a shift or preemption starts a new state), so the first `known` agree already."""
    n = min(len(state.cached), len(token_ids))
    i = min(state.known, n)
    while i < n and state.cached[i] == token_ids[i]:
        i += 1
    return i
