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
