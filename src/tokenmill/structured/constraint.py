"""One sequence's grammar state: which tokens may come next, and what has been accepted so far.

The state follows the sequence's output tokens, which survive preemption and context shifts (both
recompute the cache from the same tokens), so it never has to be rebuilt; a forked sample gets a
copy of its parent's state."""
from __future__ import annotations

import llguidance
import torch

# How a sequence's error starts when its grammar stopped it (the server answers it as the client's
# grammar's problem, a 400, not a server failure).
GRAMMAR_FAILED = "the grammar could not be followed"


def grammar_failure(num_accepted: int, error: str | None) -> str:
    """The error of a sequence whose grammar refused its next token. The mask only offers tokens the
    grammar allows, so this is the grammar library giving up: a parser limit (a grammar too ambiguous
    or with too many alternatives at one point, or one with no finite output)."""
    detail = " ".join((error or "parser error").replace("<non-verbose/>", "").split())
    return (f"{GRAMMAR_FAILED} after {num_accepted} output tokens: {detail[:300]}; "
            f"simplify the grammar or schema (fewer alternatives at one point, a way to finish)")


class Constraint:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's; a logits row may be wider (padding ids)

    @property
    def num_mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (contiguous int32, one bit per token id).
        Releases the GIL while it computes, so it can run beside the model step."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (then it is in an
        error state for good)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The output matches the grammar and nothing can follow it (only EOS could)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (more may still follow)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None if self._matcher.is_error() else None

    def fork(self) -> "Constraint":
        return Constraint(self._matcher.deep_copy(), self.vocab_size)
