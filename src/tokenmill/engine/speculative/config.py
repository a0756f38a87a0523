"""Speculative decoding settings: the method, how many tokens a step may propose per sequence, the
prompt-lookup n-gram sizes, the draft model, and when to back off."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.sampling_params import MAX_SPECULATIVE_TOKENS

METHODS = ("off", "ngram", "draft")
DRAFT_PREFIX = "draft:"


class SpecConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SpecConfig:
    # "ngram": prompt lookup (speculative/ngram.py); "draft": a smaller model with the same vocabulary
    # (speculative/draft.py, the model named by draft_model); "off": none unless a request asks for it.
    method: str = "ngram"
    num_tokens: int = 16              # most proposals per step and sequence (k)
    # The shortest suffix looked up. Not 1: after a 1-token match SmolLM2's proposals were accepted 33%
    # of the time in grounded answers and 12% in open-ended ones, and proposing there lost more than it
    # won once the policy (policy.py, learned step costs, copies) sized proposals well. bench speculative's
    # prompts, the engine's proposer, 2 threads: one engine alternating proposers of 1..8 and 2..8, ten
    # rounds, open-ended 0.96x -> 1.01x of plain decoding, grounded 1.59x -> 1.60x; replayed
    # (bench/speculative_bound.py's model, four step-cost tables, 128- and 256-token answers) open-ended
    # +1% to +3%, grounded -1% to +3%.
    ngram_min: int = 2
    ngram_max: int = 8                # longest suffix looked up (tried first)
    # A match whose agreement with the context runs this many tokens back is a copy in progress: its
    # proposals are sized by how copies fare (NgramProposer.copies), not by the sequence's own record.
    copy_tokens: int = 16
    # Back-off: after `max_misses` verifications in a row that accepted nothing, a sequence stops
    # proposing for `cooldown_steps` steps, doubled after every further failed retry (up to
    # max_cooldown_steps) and reset by an accepted token.
    max_misses: int = 6
    cooldown_steps: int = 4
    max_cooldown_steps: int = 64
    # The cost of one more row in a step, as a share of a step's fixed cost, and the acceptance rate
    # a sequence is assumed to have before its first verification: together they decide how many
    # tokens (up to num_tokens) are worth proposing (speculative/policy.py).
    row_cost: float = 0.27
    prior_acceptance: float = 0.6
    # A row's attention reads its sequence's whole context: the row cost grows with it, doubling at
    # this many tokens (SmolLM2 measured about 0.3 at 300 tokens, 0.6 at 4,000).
    row_cost_context: int = 3300
    # Size proposals from what steps of each row count took on this machine (policy.StepCosts) once the
    # engine has seen some; row_cost above is the prior until then (and always, when off).
    learn_step_costs: bool = True
    learned_cost_rows: int = 4  # ... for sequences in steps of at most this many rows (proposer.step_cost)
    # The draft model (method "draft"): a name or .gguf path, as `serve` takes its model, and what one
    # of its single-token steps costs as a share of the target's (None: the ratio of their weights'
    # bytes, which is what a memory-bound decode step reads).
    draft_model: str | None = None
    draft_cost: float | None = None

    @classmethod
    def parse_method(cls, value: str) -> tuple[str, str | None]:
        """`off`, `ngram` or `draft:MODEL` -> (method, draft model)."""
        if value.startswith(DRAFT_PREFIX):
            name = value[len(DRAFT_PREFIX):].strip()
            if not name:
                raise SpecConfigError("speculative draft: needs a model, e.g. draft:smollm2")
            return "draft", name
        if value not in ("off", "ngram"):
            raise SpecConfigError(f"speculative must be off, ngram or draft:MODEL, got {value!r}")
        return value, None

    def validate(self) -> None:
        if self.method not in METHODS:
            raise SpecConfigError(f"speculative must be off, ngram or draft:MODEL, got {self.method!r}")
        if (self.method == "draft") != bool(self.draft_model):
            raise SpecConfigError("a draft model goes with speculative draft:MODEL, and only with it")
        if self.draft_cost is not None and not self.draft_cost >= 0:
            raise SpecConfigError(f"draft_cost must be >= 0, got {self.draft_cost}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SpecConfigError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                                  f"got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecConfigError(f"spec_ngram_min and spec_ngram_max need 1 <= min <= max, "
                                  f"got {self.ngram_min} and {self.ngram_max}")
        if self.ngram_max > 16:
            raise SpecConfigError(f"spec_ngram_max must be at most 16, got {self.ngram_max}")
        for name in ("max_misses", "cooldown_steps", "max_cooldown_steps", "copy_tokens"):
            if getattr(self, name) < 1:
                raise SpecConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.row_cost_context < 1:
            raise SpecConfigError(f"row_cost_context must be at least 1, got {self.row_cost_context}")
        if not self.row_cost > 0:
            raise SpecConfigError(f"row_cost must be positive, got {self.row_cost}")
        if not 0 <= self.prior_acceptance < 1:
            raise SpecConfigError(f"prior_acceptance must be in [0, 1), got {self.prior_acceptance}")
