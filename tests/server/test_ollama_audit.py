"""Gaps found auditing the Ollama API against the official `ollama` client, and the runner API against
llama-server: each test drives one through HTTP, as those clients do."""
from __future__ import annotations

import ollama
import pytest

from server_helpers import model_name

GREEDY = {"temperature": 0, "num_predict": 3}


@pytest.fixture
def oll(tiny):
    return ollama.Client(host=tiny[0])


@pytest.mark.parametrize("name, value, kind", [("mirostat", "x", "an integer"), ("penalize_newline", "x", "true or false"),
                                               ("num_thread", 1.5, "an integer"), ("mirostat_tau", "x", "a number"),
                                               ("use_mmap", 1, "true or false")])
def test_ignored_options_are_still_type_checked(oll, tiny, name, value, kind):
    """Options that change nothing here were accepted with any value; a wrong-typed one is a 400 naming it."""
    with pytest.raises(ollama.ResponseError) as exc:
        oll.generate(model=model_name(tiny[1]), prompt="hi", options={**GREEDY, name: value})
    assert exc.value.status_code == 400
    assert exc.value.error.startswith(f"options.{name} must be {kind}")


def test_ignored_options_of_the_right_type_are_accepted(oll, tiny):
    opts = {**GREEDY, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "penalize_newline": True,
            "num_thread": 4, "num_gpu": -1, "use_mmap": False, "tfs_z": 1.0}
    r = oll.generate(model=model_name(tiny[1]), prompt="hi", options=opts)
    assert r.done and r.eval_count == 3


def test_push_says_it_is_not_supported(oll, tiny):
    """/api/push was a bare 404 "Not Found", which the client reads as a missing model."""
    with pytest.raises(ollama.ResponseError) as exc:
        oll.push(model_name(tiny[1]))
    assert exc.value.status_code == 501 and "push is not supported" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        list(oll.push(model_name(tiny[1]), stream=True))
    assert exc.value.status_code == 501


# --- the runner API (llama-server) ------------------------------------------------------------------
RUNNER = {"n_predict": 3, "temperature": 0}


def test_completion_takes_a_mix_of_text_and_token_ids(client):
    """llama-server's [12, "text", 34] is one prompt: the text tokenized in place (BOS only before a
    leading string). It was a 400."""
    ids = client.post("/tokenize", json={"content": "hello", "add_special": False}).json()["tokens"]
    assert len(ids) > 1
    mixed = client.post("/completion", json={"prompt": [ids[0], "ello" if len(ids) == 2 else "x", 7], **RUNNER})
    assert mixed.status_code == 200, mixed.text
    body = mixed.json()
    as_ids = ids[:1] + client.post("/tokenize", json={"content": "ello" if len(ids) == 2 else "x",
                                                      "add_special": False}).json()["tokens"] + [7]
    assert body["tokens_evaluated"] == len(as_ids)
    same = client.post("/completion", json={"prompt": as_ids, **RUNNER}).json()
    assert body["content"] == same["content"] and body["tokens"] == same["tokens"]


def test_completion_of_several_prompts_answers_an_array(client):
    prompts = ["hello", [5, 6, 7], ["hi", 9]]
    r = client.post("/completion", json={"prompt": prompts, **RUNNER})
    assert r.status_code == 200, r.text
    results = r.json()
    assert [x["index"] for x in results] == [0, 1, 2]
    for prompt, got in zip(prompts, results):
        alone = client.post("/completion", json={"prompt": prompt, **RUNNER}).json()
        assert got["content"] == alone["content"] and got["tokens_evaluated"] == alone["tokens_evaluated"]
        assert alone["index"] == 0 and got["stop"] is True


def test_completion_of_several_prompts_streams_each_with_its_index(client):
    import json

    prompts = ["hello", [5, 6, 7]]
    with client.stream("POST", "/completion", json={"prompt": prompts, "stream": True, **RUNNER}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for i, prompt in enumerate(prompts):
        mine = [e for e in events if e["index"] == i]
        assert mine[-1]["stop"] is True and sum(1 for e in mine if e["stop"]) == 1
        alone = client.post("/completion", json={"prompt": prompt, **RUNNER}).json()
        assert "".join(e["content"] for e in mine) == alone["content"]


@pytest.mark.parametrize("prompt, message", [
    ([["a"]], "prompt[0] must be a string, a list of token ids, or a list of strings and token ids"),
    ([1, "x", True], "prompt[0] must be a string"),  # not a mixed prompt: read as a list of prompts
    ({"text": "x"}, "prompt must be a string, a list of token ids"),
    (["ok", [1, 99999]], "prompt[1]: token id 99999 is outside the vocabulary"),
    ([1, "x", 99999], "prompt: token id 99999 is outside the vocabulary"),
    ([], "prompt is empty"),
])
def test_completion_bad_prompts_are_400s_naming_the_prompt(client, prompt, message):
    r = client.post("/completion", json={"prompt": prompt, **RUNNER})
    assert r.status_code == 400 and r.json()["error"].startswith(message), r.text


@pytest.mark.parametrize("field, value, message", [("cache_prompt", "yes", "cache_prompt must be true or false"),
                                                   ("id_slot", "x", "id_slot must be an integer"),
                                                   ("id_slot", -2, "id_slot must be at least -1")])
def test_completion_accepted_no_op_fields_are_type_checked(client, field, value, message):
    """cache_prompt and id_slot change nothing here, but a wrong-typed one was silently taken."""
    assert client.post("/completion", json={"prompt": "hi", field: value, **RUNNER}).json()["error"].startswith(message)
    ok = {"cache_prompt": False, "id_slot": 0}[field]
    assert client.post("/completion", json={"prompt": "hi", field: ok, **RUNNER}).status_code == 200


def test_props_gives_the_context_template_and_defaults(client, tiny):
    """GET /props, which llama-server clients read n_ctx and the chat template from, was a 404."""
    r = client.get("/props")
    assert r.status_code == 200, r.text
    props = r.json()
    engine = tiny[1].current.engine
    assert props["default_generation_settings"]["n_ctx"] == engine.max_model_len
    assert "im_start" in props["chat_template"]
    assert props["model_path"] == model_name(tiny[1]) and "/" not in props["model_path"]  # never a server path
    params = props["default_generation_settings"]["params"]
    # The defaults it lists are the ones /completion uses: spelled out, a seeded run samples the same tokens.
    explicit = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")}
    a = client.post("/completion", json={"prompt": "hi", "n_predict": 4, "seed": 3}).json()
    b = client.post("/completion", json={"prompt": "hi", "n_predict": 4, "seed": 3, **explicit}).json()
    assert a["tokens"] == b["tokens"]
    assert client.get("/props", params={"model": "../x"}).status_code == 400


def test_slots_is_refused_as_llama_server_without_slots(client):
    r = client.get("/slots")
    assert r.status_code == 501 and "does not support slots" in r.json()["error"]


def test_apply_template_renders_what_tokenize_would(client):
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "hi" in prompt
    by_messages = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    by_text = client.post("/tokenize", json={"content": prompt, "add_special": False}).json()["tokens"]
    assert by_messages == by_text
    assert client.post("/apply-template", json={}).json()["error"] == "messages is required"
    bad = client.post("/apply-template", json={"messages": [{"role": "bogus", "content": "x"}]})
    assert bad.status_code == 400 and "messages[0].role" in bad.json()["error"]


@pytest.mark.parametrize("value, shown", [(True, "got true"), ([1], "got [1]"), ("5x", '"5x" is not a duration'),
                                          ("9" * 5000 + "x", '"99999')])
def test_bad_keep_alive_is_a_400_that_shows_the_value_briefly(client, tiny, value, shown):
    """The value was echoed as Python's repr (True, '5x') and in full, however long."""
    r = client.post("/api/generate", json={"model": model_name(tiny[1]), "prompt": "hi", "keep_alive": value})
    assert r.status_code == 400 and shown in r.json()["error"] and len(r.json()["error"]) < 200, r.text


def test_tokenize_with_pieces_gives_each_tokens_text(client):
    """llama-server's with_pieces was ignored (bare ids came back)."""
    plain = client.post("/tokenize", json={"content": "hello", "add_special": False}).json()["tokens"]
    r = client.post("/tokenize", json={"content": "hello", "add_special": False, "with_pieces": True}).json()
    assert [t["id"] for t in r["tokens"]] == plain
    assert "".join(t["piece"] for t in r["tokens"]) == "hello"
    assert client.post("/tokenize", json={"content": "x", "with_pieces": "yes"}).status_code == 400
