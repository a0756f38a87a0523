"""Real Gemma 3 270M (Q4_K_M GGUF) against transformers loading the same file, dequantized."""
from __future__ import annotations

import pytest
import torch

from model_helpers import greedy, hf_model, prefill_logits
from tokenmill.model import load_model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nWhat is 17 times 23?<end_of_turn>\n<start_of_turn>model\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "東京は日本の首都です。 In English: Tokyo is",
]
# Past the 512-key sliding window, so the local layers' masks decide the result.
LONG = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60))


@pytest.fixture(scope="module")
def pair(gemma3_path, gemma3_reference):
    return load_model(gemma3_path, torch.float32).model, hf_model(gemma3_path), gemma3_reference


def test_last_position_logits_within_1e_3(pair):
    ours, ref, tok = pair
    for prompt in [*PROMPTS, LONG]:
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0, -1]
        diff = (prefill_logits(ours, ids, chunk=256) - expected).abs().max().item()
        assert diff < 1e-3, f"{prompt[:40]!r} ({len(ids)} tokens): max |logit diff| {diff}"
    assert len(tok(LONG).input_ids) > 512 + 256  # the last chunk attends across the window


def test_greedy_32_tokens_identical_fp32(pair):
    ours, ref, tok = pair
    for prompt in PROMPTS[:2]:
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert greedy(ours, ids, 32) == expected[0, len(ids):].tolist(), prompt
