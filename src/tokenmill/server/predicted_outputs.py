"""OpenAI's Predicted Outputs (`prediction` on /v1/chat/completions): text the answer is expected to
repeat, such as the file a code edit rewrites. Prompt lookup searches it as it searches the context
(engine/speculative/), so a known answer is verified many tokens a step; the answer is the model's
whatever the prediction says (greedy output is unchanged). The usage reports how much of it was used,
in OpenAI's terms: accepted_prediction_tokens appear in the answer, rejected_prediction_tokens do not.
Not billed here, so completion_tokens stays what was generated."""
from __future__ import annotations

from collections import Counter

from tokenmill.server.errors import bad_request, shown_value
from tokenmill.tokenizer import Tokenizer


def prediction_text(body: dict) -> str | None:
    """The request's predicted content: {"type": "content", "content": text or [text parts]}; a 400 for
    anything else."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise bad_request('prediction must be {"type": "content", "content": ...}', "prediction")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"prediction.content must be a string or a list of text parts, got {shown_value(content)}",
                      "prediction.content")


def prediction_ids(tokenizer: Tokenizer, text: str, limit: int) -> tuple[int, ...]:
    """The prediction's tokens, at most `limit` (the context: no answer repeats more)."""
    return tuple(tokenizer.encode(text, add_special_tokens=False)[:limit])


def prediction_usage(prediction: tuple[int, ...], outputs: list[list[int]]) -> dict:
    """completion_tokens_details of the choices' outputs, summed over them: the prediction's tokens that
    appear in each answer (as many times as in both: a count, not a diff, so that it costs time linear in
    the lengths; a diff of an 8k-token prediction against a long answer of repeated tokens took seconds
    on the event loop), and the rest."""
    predicted = Counter(prediction)
    accepted = rejected = 0
    for out in outputs:
        matched = sum((predicted & Counter(out)).values())
        accepted += matched
        rejected += len(prediction) - matched
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}
