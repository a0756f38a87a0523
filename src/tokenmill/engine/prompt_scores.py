"""Logprobs of a prompt's own tokens (SamplingParams.prompt_logprobs): the runner hands back the hidden
states of the prompt rows a step computed, and each row's logits score the prompt token after it.
The head runs over a few rows at a time, so a long prompt never holds [prompt, vocab] logits (a
512-token chunk of Gemma 3's 262,144-entry vocabulary would be 537 MB)."""
from __future__ import annotations

import torch

from tokenmill.engine.runner import PromptRows
from tokenmill.kernels.logprobs import row_logprobs

ROWS_PER_HEAD_CALL = 64


def score_prompt_rows(model: torch.nn.Module, rows: list[PromptRows]) -> None:
    """Append each row's score to its sequence's prompt_scores, in position order."""
    for r in rows:
        seq = r.seq
        if r.first != len(seq.prompt_scores):  # each chunk's rows arrive in order, once
            raise RuntimeError(f"prompt scores of sequence {seq.seq_id} out of order: "
                               f"{r.first} after {len(seq.prompt_scores)}")
        k = seq.params.prompt_logprobs or 0
        for i in range(0, len(r.hidden), ROWS_PER_HEAD_CALL):
            hidden = r.hidden[i:i + ROWS_PER_HEAD_CALL]
            start = r.first + i + 1
            targets = torch.tensor(seq.prompt_ids[start:start + len(hidden)], dtype=torch.int64, device=hidden.device)
            with torch.inference_mode():
                logits = model.logits(hidden).float()
            chosen, values, ids = row_logprobs(logits, targets, k)
            tops = [list(zip(a, b)) for a, b in zip(ids.tolist(), values.tolist())]
            seq.prompt_scores += zip(chosen.tolist(), tops)
