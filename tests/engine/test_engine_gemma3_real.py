"""Real Gemma 3 270M through the engine, in fp32, against transformers' greedy generate: the
tokenizer's ids and its built-in chat template, batching with chunked prefill, and a prompt past the
512-key sliding window."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import make_engine, run_to_completion
from model_helpers import hf_model
from tokenmill.engine import SamplingParams
from tokenmill.model import load_model

pytestmark = pytest.mark.real_model

# The 270M file is the pretrained (not instruction-tuned) model: the chat prompt checks the template's
# ids, the completion prompt that the model's output makes sense.
CHAT = [{"role": "system", "content": "Answer in one short sentence."}, {"role": "user", "content": "Why is the sky blue?"}]
QUESTION = "Question: What is the capital of France?\nAnswer:"
LONG = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(50))


def test_batched_greedy_matches_transformers(gemma3_path):
    loaded = load_model(gemma3_path, torch.float32)
    engine = make_engine(loaded, n_batch=256, n_ubatch=256)
    tok = engine.tokenizer
    prompts = [tok.encode(QUESTION), tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False),
               tok.encode(LONG + " Which box holds 12 stones?")]
    assert prompts[1][:3] == [tok.bos_id, 105, 2364]  # <bos><start_of_turn>user
    assert len(prompts[-1]) > 600
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = run_to_completion(engine, [(p, params) for p in prompts], check_every_step=False)
    ref = hf_model(gemma3_path)
    for ids, out in zip(prompts, got):
        with torch.inference_mode():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert out == expected[0, len(ids):].tolist()
    assert "Paris" in tok.decode(got[0])
