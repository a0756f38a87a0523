"""Draft-model proposals (`--speculative draft:MODEL`): a smaller model with the same vocabulary decodes
k tokens greedily after a sequence's context, and the target verifies them in its next step like any
proposals (verify.py: a greedy draft puts all its mass on one token, so the rejection rule there holds
unchanged, and greedy output stays the target's own).

The draft keeps its own KV cache: its layers, heads and head size differ from the target's, so its K/V
cannot live in the target's blocks. It gets its own KVStorage and BlockManager (no prefix caching),
with as many token slots as the target's cache, allocated lazily like the target's. Each speculating
sequence owns a table there that follows its context: after a verification, the draft's tokens past
the part the target agreed with are overwritten by the target's, so a step recomputes only those and
the token the target added, then decodes k - 1 more. A step's sequences do this together (the
scheduler asks for all their proposals at once): one batched forward of everyone's catch-up rows,
then one of a row each per further proposal. When the draft's cache is full the sequence simply
proposes nothing that step: a draft never preempts anyone or fails a request."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.engine.speculative.config import SpecConfig
from tokenmill.engine.speculative.policy import AcceptanceRate, StepCosts, best_num_tokens
from tokenmill.engine.speculative.proposer import BackOff, any_could_pay, step_cost
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import ChunkSpec
from tokenmill.model.paged_batch import PagedBatch

log = logging.getLogger(__name__)


@dataclass
class DraftRequest:
    """One sequence's ask of a draft step: k greedy tokens after token_ids, for its table `key`, whose
    first `keep` cached tokens are token_ids' own."""
    key: int
    keep: int
    token_ids: Sequence[int]
    k: int


@dataclass
class _Running:
    """A request being decoded: its block table in the draft's cache, and its tokens so far."""
    ask: DraftRequest
    table: list[int]
    out: list[int] = field(default_factory=list)


class DraftModel:
    """The draft's weights and its own paged KV cache; greedy decoding of several sequences at once,
    one batched forward per proposal position (the native kernels compute each row as alone, so the
    batch changes no proposal)."""

    def __init__(self, model: torch.nn.Module, kv: KVStorage, n_ubatch: int, context_length: int,
                 weight_bytes: int = 0):
        self.model = model
        self.kv = kv
        self.weight_bytes = weight_bytes
        self.blocks = BlockManager(kv.num_blocks, kv.block_size, enable_prefix_caching=False)
        self.n_ubatch = n_ubatch
        self.max_len = min(context_length, kv.num_blocks * kv.block_size)
        self.num_forwards = 0  # batched forwards run (tests see that several sequences share them)

    def generate(self, key: int, keep: int, token_ids: Sequence[int], k: int) -> list[int]:
        """k greedy tokens after token_ids for the table `key`; [] when its cache has no room."""
        return self.generate_many([DraftRequest(key, keep, token_ids, k)])[key]

    @torch.inference_mode()
    def generate_many(self, asks: list[DraftRequest]) -> dict[int, list[int]]:
        """Each ask's tokens by key ([] for one whose cache has no room: nothing then changes for it but
        a trimmed tail). Each sequence first computes what its table lacks of its context (the last
        token always: its row gives the first proposal), then the sequences still wanting tokens feed
        their last one back, one row each per forward."""
        out: dict[int, list[int]] = {}
        running: list[_Running] = []
        last_pieces: list[tuple[_Running, int]] = []  # (sequence, where its context's last piece starts)
        for ask in asks:
            n_ids = len(ask.token_ids)
            total = n_ids + ask.k - 1  # the context, and the proposals but the last fed back
            keep = min(ask.keep, n_ids - 1)
            out[ask.key] = []
            if ask.k < 1 or total > self.max_len:
                continue
            self.blocks.trim(ask.key, keep)
            if not self.blocks.can_allocate(ask.key, total):
                continue
            self.blocks.allocate(ask.key, total)
            r = _Running(ask, self.blocks.block_table(ask.key))
            # A long catch-up (a new sequence's prompt) runs alone, n_ubatch tokens at a time; its
            # last piece joins the others'.
            last = keep + (n_ids - 1 - keep) // self.n_ubatch * self.n_ubatch
            for start in range(keep, last, self.n_ubatch):
                self._forward([(ask.token_ids[start:start + self.n_ubatch], start, r.table)])
            last_pieces.append((r, last))
            running.append(r)
        self._decode([(r, list(r.ask.token_ids[start:]), start) for r, start in last_pieces])
        for i in range(1, max((r.ask.k for r in running), default=0)):
            self._decode([(r, [r.out[-1]], len(r.ask.token_ids) + i - 1) for r in running if r.ask.k > i])
        for r in running:
            out[r.ask.key] = r.out
        return out

    def release(self, key: int) -> None:
        self.blocks.free(key)

    @property
    def nbytes(self) -> int:
        """Its weights and its whole KV cache (allocated as used, like the target's)."""
        return self.weight_bytes + self.kv.nbytes

    def _decode(self, rows: list[tuple[_Running, list[int], int]]) -> None:
        """Each sequence's chunk (ids from position start), in forwards of at most n_ubatch tokens;
        the argmax of each chunk's last row is its next token."""
        group: list[tuple[_Running, list[int], int]] = []
        size = 0
        for row in rows:
            if group and size + len(row[1]) > self.n_ubatch:
                self._decode_group(group)
                group, size = [], 0
            group.append(row)
            size += len(row[1])
        if group:
            self._decode_group(group)

    def _decode_group(self, group: list[tuple[_Running, list[int], int]]) -> None:
        hidden = self._forward([(ids, start, r.table) for r, ids, start in group])
        ends = torch.tensor(list(itertools.accumulate(len(ids) for _, ids, _ in group))) - 1
        for (r, _, _), token in zip(group, torch.argmax(self.model.logits(hidden, ends), dim=-1).tolist()):
            r.out.append(int(token))

    def _forward(self, chunks: list[tuple[Sequence[int], int, list[int]]]) -> torch.Tensor:
        self.num_forwards += 1
        meta = PagedBatch.build([ChunkSpec(table, start, len(ids)) for ids, start, table in chunks], self.kv.block_size)
        ids = torch.tensor([t for chunk, _, _ in chunks for t in chunk])
        positions = torch.cat([torch.arange(start, start + len(chunk)) for chunk, start, _ in chunks])
        return self.model(ids, positions, meta, self.kv)


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

    searches_prediction = False  # a draft proposes from the context alone (Speculator._lookup_ids)

    def any_could_pay(self, states: list[DraftState | None], num_rows: int) -> bool:
        """Whether a proposal of any of these sequences could pay in a step of num_rows rows, before the
        draft's own cost (which only makes paying harder): proposer.any_could_pay."""
        return any_could_pay(self.cfg, self.costs, num_rows,
                             max((self.cfg.prior_acceptance if s is None else s.rate.value) for s in states))

    def propose_many(self, asks: list[tuple[DraftState | None, Sequence[int], int, int]],
                     num_rows: int = 1) -> list[tuple[DraftState, list[int]]]:
        """Proposals for several sequences (state, context, shifted tokens, cap), their draft tokens
        decoded together: one batched draft forward per proposal position, not one per sequence."""
        states, sizes = [], []
        for state, token_ids, num_shifted_tokens, cap in asks:
            if state is None or state.num_shifted_tokens != num_shifted_tokens:
                if state is not None:
                    self.forget(state)
                state = self.new_state(num_shifted_tokens)
            k = 0
            if not state.backoff.cooling() and cap > 0:
                cost = step_cost(self.cfg, self.costs, len(token_ids), num_rows)
                k = best_num_tokens(state.rate.value, num_rows, cost, cap, self.draft_cost)
            states.append(state)
            sizes.append(k)
        wanted = [(state, ask[1], k) for state, ask, k in zip(states, asks, sizes) if k]
        drafts = self._generate(wanted) if wanted else {}
        out = []
        for state, (_, token_ids, _, _) in zip(states, asks):
            draft = drafts.get(state.key, [])
            if draft:
                state.cached = [*token_ids, *draft[:-1]]
                state.known = len(token_ids)
            else:  # keep only what is still the context's (a failed generate may have trimmed past it)
                state.rate.idle()
                state.cached = state.cached[:min(_agreeing(state, token_ids), len(token_ids) - 1)]
                state.known = len(state.cached)
            out.append((state, draft))
        return out

    def _generate(self, wanted: list[tuple[DraftState, Sequence[int], int]]) -> dict[int, list[int]]:
        """The draft's tokens by state key, or none when its step fails: proposals are optional, so a
        draft's error must not fail the target's requests (the tables of that step go back, and those
        sequences start over there)."""
        try:
            return self.draft.generate_many([DraftRequest(s.key, _agreeing(s, ids), ids, k) for s, ids, k in wanted])
        except Exception:  # noqa: BLE001 - see above; logged in full the first time, counted after
            self.num_failures += 1
            if self.num_failures == 1:
                log.exception("the draft model's step failed; its sequences propose nothing this step")
            else:
                log.warning("the draft model's step failed again (%d failures)", self.num_failures)
            for state, _, _ in wanted:
                self.forget(state)
            return {}

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
