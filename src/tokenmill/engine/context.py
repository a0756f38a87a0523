"""Fitting a sequence into its context window: prompt truncation on admission and context shift
during generation. Pure functions over token lists; the engine and scheduler apply them.

Both keep the first `num_keep` tokens (a system prompt, BOS) and drop from right after them, the
oldest tokens that matter least, as Ollama's runner does."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Truncation:
    token_ids: list[int]
    num_keep: int      # leading tokens kept (num_keep as asked, clamped to fit)
    num_dropped: int   # tokens cut from right after them


def generation_reserve(limit: int, max_tokens: int | None) -> int:
    """Room a truncated prompt leaves for the answer: max_tokens, but at most a quarter of the
    context (a long answer must not eat the whole prompt) and at least one token."""
    want = limit if max_tokens is None else max_tokens
    return max(1, min(want, limit // 4))


def truncate_prompt(prompt_ids: list[int], limit: int, num_keep: int, reserve: int) -> Truncation:
    """Keep the first num_keep tokens and the newest tail so that the prompt is at most
    limit - reserve tokens. A prompt that already fits is returned unchanged."""
    target = limit - reserve
    if target < 1:
        raise ValueError(f"context of {limit} leaves no room for a prompt with a reserve of {reserve}")
    if len(prompt_ids) <= target:
        return Truncation(list(prompt_ids), min(num_keep, len(prompt_ids)), 0)
    keep = max(0, min(num_keep, target - 1))  # at least the last prompt token survives
    tail = target - keep
    dropped = len(prompt_ids) - keep - tail
    return Truncation(prompt_ids[:keep] + prompt_ids[len(prompt_ids) - tail:], keep, dropped)


def shift_context(token_ids: list[int], num_keep: int) -> tuple[list[int], int]:
    """Drop the older half of the tokens after num_keep: (kept tokens, number dropped)."""
    keep = max(0, min(num_keep, len(token_ids) - 2))  # something must go, the newest must stay
    discard = max(1, (len(token_ids) - keep) // 2)
    return token_ids[:keep] + token_ids[keep + discard:], discard
