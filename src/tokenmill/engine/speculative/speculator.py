"""The engine's side of speculative decoding: how many tokens a sequence may propose this step (its
request's wishes, what is left of its max_tokens and context, the step's budget), the proposals, and
the acceptance counters for /metrics.

A grammar-constrained sequence's proposals are cut at the first token its grammar does not allow
(and before one that completes it: nothing may follow that); each proposed row then samples under the
mask of the grammar advanced through the proposals before it (`grammar_rows`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenmill.engine.speculative.config import SpecConfig
from tokenmill.engine.speculative.ngram import SEPARATOR
from tokenmill.engine.speculative.proposer import NgramProposer, SpecCounters

if TYPE_CHECKING:
    from tokenmill.engine.request import Sequence
    from tokenmill.structured import Constraint


class Speculator:
    def __init__(self, cfg: SpecConfig, counters: SpecCounters | None = None, proposer=None):
        cfg.validate()
        self.cfg = cfg
        # Prompt lookup, or a draft model's (speculative/draft.py, built by speculative/build.py): both
        # keep their per-sequence state on seq.spec and answer propose_many / observe / forget.
        self.proposer = proposer if proposer is not None else NgramProposer(cfg)
        self.counters = counters if counters is not None else SpecCounters()
        self._propose_seconds = 0.0  # this step's time in propose (a draft model's steps)

    @property
    def nbytes(self) -> int:
        """Memory the proposer holds (a draft model's weights and KV cache), for the server's budget."""
        return self.proposer.nbytes

    def num_wanted(self, seq: "Sequence") -> int:
        """The most tokens seq may propose in a step: its request's choice (speculative,
        num_speculative_tokens) over the engine's, capped by what it may still generate, 0 when it
        must not (a grammar constrains it) or would gain nothing."""
        p = seq.params
        on = p.speculative if p.speculative is not None else self.cfg.method != "off"
        if not on:
            return 0
        k = p.num_speculative_tokens if p.num_speculative_tokens is not None else self.cfg.num_tokens
        # Never propose past max_tokens or the context: the last row would be computed for nothing,
        # and a run that filled the context would need a shift in the middle.
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - len(seq.output_ids) - 1)
        k = min(k, seq.max_model_len - seq.num_tokens - 1)
        return max(k, 0)

    def propose_all(self, seqs: list["Sequence"], num_rows: int) -> dict[int, list[int]]:
        """Proposals for each decoding sequence of a step of about num_rows rows, by seq_id: up to
        num_wanted's, as many as its acceptance rate makes worth their rows (policy.py). Asked at once, so
        that a draft model decodes them as one batch. In a step where the proposer says none of them
        could pay (a large batch), none is asked: in a 16-request burst of bench speculative's prompts,
        asking each sequence every step to propose nothing took 0.4% of the burst's time."""
        if not seqs or not self.proposer.any_could_pay([seq.spec for seq in seqs], num_rows):
            return {}
        asks = [(seq, self.num_wanted(seq)) for seq in seqs]
        asks = [(seq, max(cap, 0)) for seq, cap in asks if cap > 0 or seq.spec is not None]
        if not asks:
            return {}
        start = time.perf_counter()
        results = self.proposer.propose_many(
            [(seq.spec, self._lookup_ids(seq), seq.num_shifted_tokens, cap) for seq, cap in asks], num_rows)
        self._propose_seconds += time.perf_counter() - start
        drafts = {}
        for (seq, _), (state, draft) in zip(asks, results):
            seq.spec = state
            drafts[seq.seq_id] = draft
        return drafts

    def _lookup_ids(self, seq: "Sequence") -> list[int]:
        """What a sequence's proposals come from: its context, after its request's predicted output (and
        a separator no token matches, so that no match spans the two) when the proposer looks tokens up.
        The list only grows, as the proposer's index needs. (The prior cost model prices a row by this
        list's length, a long prediction's too: in a large batch its proposals come out shorter, never
        wrong.)"""
        ids = seq.all_token_ids
        prediction = seq.params.prediction_ids
        if prediction and getattr(self.proposer, "searches_prediction", False):
            return [*prediction, SEPARATOR, *ids]
        return ids

    def observe_step(self, rows: int, model_seconds: float, step_seconds: float, has_prefill: bool = False) -> None:
        """After each step: its rows, the model's and sampler's time, and the whole step's, which teach
        the proposer what rows cost here (policy.StepCosts), unless a prefill chunk was among them (its
        rows take no logits; a request's first steps run cold). Time spent proposing is not a step's
        fixed part: a draft model's steps are priced per proposal."""
        other = step_seconds - model_seconds - self._propose_seconds
        self._propose_seconds = 0.0
        if not has_prefill:
            self.proposer.costs.record(rows, model_seconds, other)

    @staticmethod
    def grammar_rows(constraint: "Constraint", draft: list[int]) -> tuple[list[int], list["Constraint"]]:
        """The longest head of draft the grammar allows, stopping before a token that would complete
        it, and for each kept proposal d_j the grammar's state after d_1..d_j (the mask of row j)."""
        state = constraint.fork()
        rows: list["Constraint"] = []
        for token in draft:
            if not state.accept(token) or state.is_complete:
                break
            rows.append(state.fork())
        return draft[:len(rows)], rows

    def forget(self, seq: "Sequence") -> None:
        """seq finished or was preempted: what its proposer holds for it (a draft model's KV) goes back."""
        if seq.spec is not None:
            self.proposer.forget(seq.spec)
            seq.spec = None

    def observe(self, seq: "Sequence", num_draft_tokens: int, num_accepted: int) -> None:
        self.counters.record(num_draft_tokens, num_accepted)
        if seq.spec is not None:
            self.proposer.observe(seq.spec, num_draft_tokens, num_accepted)
