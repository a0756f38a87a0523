"""Token log-probabilities in each API's shape. A token's text is its own decode (a byte token that
is part of a UTF-8 character shows as U+FFFD), and `bytes` carries its exact bytes so clients can
rebuild such characters."""
from __future__ import annotations

from tokenmill.tokenizer import Tokenizer


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id])


def token_bytes(tok: Tokenizer, token_id: int) -> list[int]:
    return list(tok.token_bytes(token_id)) if 0 <= token_id < tok.vocab_size else []


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict:
    return {"token": token_text(tok, token_id), "logprob": logprob, "bytes": token_bytes(tok, token_id)}


def chat_entries(tok: Tokenizer, ids: list[int], logprobs: list[float] | None,
                 top: list[list[tuple[int, float]]] | None) -> list[dict]:
    """OpenAI chat `logprobs.content` items; Ollama's `logprobs` use the same shape."""
    out = []
    for i, token_id in enumerate(ids):
        entry = _entry(tok, token_id, logprobs[i] if logprobs else 0.0)
        entry["top_logprobs"] = [_entry(tok, t, lp) for t, lp in (top[i] if top else [])]
        out.append(entry)
    return out


def completion_logprobs(tok: Tokenizer, ids: list[int], logprobs: list[float] | None,
                        top: list[list[tuple[int, float]]] | None, text_offset: int) -> dict:
    """The legacy /v1/completions shape: parallel lists, and top alternatives as {text: logprob}."""
    tokens, offsets = [], []
    offset = text_offset
    for token_id in ids:
        text = token_text(tok, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops = None
    if top:
        tops = [{token_text(tok, t): lp for t, lp in alts} for alts in top]
    return {"tokens": tokens, "token_logprobs": list(logprobs or [0.0] * len(ids)), "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(tok: Tokenizer, prompt_ids: list[int],
                  scores: list[tuple[float, list[tuple[int, float]]]] | None, with_top: bool) -> dict:
    """The echoed prompt's part of a /v1/completions `logprobs`: its tokens from offset 0, the first
    with no logprob (nothing comes before it), then each scored given the ones before it (None past
    the scores there are, should the request have ended before its prompt was computed)."""
    n = len(prompt_ids)
    scores = scores or []
    part = completion_logprobs(tok, prompt_ids, None, None, 0)
    part["token_logprobs"] = ([None] + [lp for lp, _ in scores] + [None] * n)[:n]
    if with_top:
        tops = [{token_text(tok, t): v for t, v in top} for _, top in scores]
        part["top_logprobs"] = ([None] + tops + [None] * n)[:n]
    return part


def joined_logprobs(first: dict, second: dict | None) -> dict:
    """Two `logprobs` parts one after the other (an echoed prompt, then the completion)."""
    if second is None:
        return first
    top = None if first["top_logprobs"] is None and second["top_logprobs"] is None else \
        (first["top_logprobs"] or [None] * len(first["tokens"])) + (second["top_logprobs"] or [])
    joined = {key: first[key] + second[key] for key in ("tokens", "token_logprobs", "text_offset")}
    return joined | {"top_logprobs": top}
