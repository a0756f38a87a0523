"""OpenAI's predicted outputs over HTTP: `prediction` (a string or text parts) is looked up by the
speculative proposer, the answer is the same with it or without it, the usage says how much of it the
answer used (completion_tokens_details), streamed or not, and a malformed one is a 400 naming it."""
from __future__ import annotations

import json
from dataclasses import replace

import gguf
import httpx
import pytest

from server_helpers import model_name, start_server, wait_idle
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.kernels import variant

pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built: no speculation")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("pred") / "t.gguf",
                            TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=1024))
    server, host = start_server(str(path), dtype="auto", kv_size=4096)
    assert host.wait_ready(60), host.error
    # Rows cost next to nothing here, so a sequence proposes whenever its lookup matches: the test checks
    # what is looked up, not how many tokens this machine's step costs make worth proposing.
    spec = host.current.engine.scheduler.speculator
    spec.cfg = spec.proposer.cfg = replace(spec.cfg, row_cost=1e-4, learn_step_costs=False)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, host
    server.stop()


def _body(host, **more) -> dict:
    # Penalties keep the tiny model from repeating itself: prompt lookup alone finds little.
    return {"model": model_name(host), "messages": [{"role": "user", "content": "Write something."}], "max_tokens": 40,
            "temperature": 0, "presence_penalty": 2.0, "repetition_penalty": 1.5, **more}


def test_the_answer_is_the_same_and_the_usage_says_what_the_prediction_gave(served):
    client, host = served
    engine = host.current.engine
    plain = client.post("/v1/chat/completions", json=_body(host)).json()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]
    accepted_before = engine.stats.spec.num_accepted_tokens
    for prediction in (text, [{"type": "text", "text": text[:len(text) // 2]}, {"type": "text", "text": text[len(text) // 2:]}]):
        r = client.post("/v1/chat/completions", json=_body(host, prediction={"type": "content", "content": prediction}))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == text
        details = r.json()["usage"]["completion_tokens_details"]
        predicted = len(engine.tokenizer.encode(text, add_special_tokens=False))
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == predicted
        # The tiny model writes bytes that are not UTF-8: its text, encoded again, is not quite its tokens
        assert details["accepted_prediction_tokens"] >= 20
    assert engine.stats.spec.num_accepted_tokens - accepted_before >= 20  # looked up: verified many a step
    # A prediction the answer does not follow: the same answer, the prediction rejected
    noise = client.post("/v1/chat/completions", json=_body(host, prediction={"type": "content", "content": "zq" * 30})).json()
    assert noise["choices"][0]["message"]["content"] == text
    assert noise["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] < 5
    # Streamed: the same text, and the usage chunk carries the same details
    lines = client.post("/v1/chat/completions", json=_body(host, prediction={"type": "content", "content": text},
                                                          stream=True, stream_options={"include_usage": True})).text
    chunks = [json.loads(line[6:]) for line in lines.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"]["completion_tokens_details"] == details
    wait_idle(host)


@pytest.mark.parametrize("prediction, param", [
    ("text", "prediction"), ({"type": "text", "content": "x"}, "prediction"), ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "prediction.content"),
])
def test_a_malformed_prediction_is_a_400_naming_it(served, prediction, param):
    client, host = served
    r = client.post("/v1/chat/completions", json=_body(host, prediction=prediction))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.get("/health").status_code == 200


def test_the_usage_counts_the_predictions_tokens_each_answer_holds():
    from tokenmill.server.predicted_outputs import prediction_usage

    # per choice: each predicted token counted as often as both hold it; the rest rejected; summed
    assert prediction_usage((1, 2, 3, 3), [[3, 1, 9], [4]]) == {"accepted_prediction_tokens": 2,
                                                                "rejected_prediction_tokens": 6}
    assert prediction_usage((7,) * 8192, [[7] * 4096]) == {"accepted_prediction_tokens": 4096,
                                                           "rejected_prediction_tokens": 4096}
