"""Real SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers loading the same file, dequantized."""
from __future__ import annotations

import pytest
import torch

from model_helpers import greedy, hf_model, prefill_logits
from tokenmill.model import load_model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "Les fleurs du jardin sont très belles en été, et les enfants",
    "東京は日本の首都です。 In English: Tokyo is",
]


@pytest.fixture(scope="module")
def pair(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    return load_model(smollm2_path, torch.float32).model, hf_model(smollm2_path), tok


def test_last_position_logits_within_1e_3(pair):
    ours, ref, tok = pair
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0, -1]
        got = prefill_logits(ours, ids)
        diff = (got - expected).abs().max().item()
        assert diff < 1e-3, f"{prompt!r}: max |logit diff| {diff}"


def test_greedy_64_tokens_identical_fp32(pair):
    ours, ref, tok = pair
    for prompt in PROMPTS[:3]:
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
        assert greedy(ours, ids, 64) == expected[0, len(ids):].tolist(), prompt


def test_bf16_greedy_divergence_report(pair, smollm2_path, capsys):
    """bf16 is the default engine dtype: report where (if anywhere) its greedy output leaves fp32's."""
    ours, _, tok = pair
    bf16 = load_model(smollm2_path, torch.bfloat16).model
    report = []
    agree_total = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        a, b = greedy(ours, ids, 64), greedy(bf16, ids, 64)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        agree_total += 64 if first is None else first
        report.append(f"{prompt[:30]!r}: " + ("identical for 64 tokens" if first is None else f"diverges at token {first}"))
    with capsys.disabled():
        print("\nbf16 vs fp32 greedy:\n  " + "\n  ".join(report))
    # bf16 must at least start the same way; the exact point of divergence is reported, not asserted.
    assert agree_total >= len(PROMPTS)
