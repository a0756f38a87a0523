"""Real SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers loading the same file, dequantized."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import make_engine, run_one_at_a_time
from model_helpers import greedy, hf_model, prefill_logits
from tokenmill.engine import SamplingParams
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


def test_default_engine_greedy_follows_transformers(pair, smollm2_path, capsys):
    """What a user gets by default (GGUF blocks, two-plane int8 activations, bf16 KV cache, the
    engine's scheduling) against the oracle: greedy tokens the same as transformers' fp32 for at
    least the first 24 of every prompt (the divergence points are printed). With one int8 plane four
    of the five prompts left it within 15 tokens, one at the first."""
    _, ref, tok = pair
    loaded = load_model(smollm2_path)
    assert loaded.weights == "gguf"
    engine = make_engine(loaded, max_total_tokens=2048)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [tok(p).input_ids for p in PROMPTS]
    got = run_one_at_a_time(engine, [(ids, params) for ids in prompts])
    report, firsts = [], []
    for prompt, ids, out in zip(PROMPTS, prompts, got):
        with torch.inference_mode():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), None)
        firsts.append(first)
        report.append(f"{prompt[:30]!r}: " + ("identical for 32 tokens" if first is None else f"diverges at {first}"))
    with capsys.disabled():
        print("\ndefault (gguf) engine vs transformers fp32 greedy:\n  " + "\n  ".join(report))
    assert all(first is None or first >= 24 for first in firsts), report


def test_default_engine_prompt_logprobs_follow_transformers_and_ignore_batching(pair, smollm2_path):
    """Prompt logprobs (OpenAI's echo with logprobs, as lm-eval's loglikelihood tasks ask for them) on
    the default path against transformers' fp32 log_softmax over the same prompt; and bitwise the
    same in one step, in 16-token chunks, and beside other requests (the quantized kernels' rows do
    not depend on their batch)."""
    _, ref, tok = pair
    loaded = load_model(smollm2_path)
    assert loaded.weights == "gguf"
    prompts = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)

    def scores(engine, requests):
        rids = [engine.add_request(ids, p) for ids, p in requests]
        got = {}
        while engine.has_unfinished():
            for ev in engine.step():
                if ev.prompt_logprobs is not None:
                    got[ev.request_id] = ev.prompt_logprobs
        return [got.get(r) for r in rids]

    alone = [scores(make_engine(loaded, max_total_tokens=2048), [(ids, params)])[0] for ids in prompts]
    chunked = scores(make_engine(loaded, max_total_tokens=2048, n_batch=16), [(ids, params) for ids in prompts])
    assert chunked == alone
    diffs, top_agree = [], []
    for ids, got in zip(prompts, alone):
        with torch.inference_mode():
            logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert len(got) == len(ids) - 1
        for j, (lp, top) in enumerate(got):
            diffs.append(abs(lp - logp[j, ids[j + 1]].item()))
            top_agree.append(top[0][0] == int(logp[j].argmax()))
    # Measured: max 0.0054, mean 0.0010 over 84 positions, top-1 the same at all of them.
    assert max(diffs) < 0.03 and sum(diffs) / len(diffs) < 0.003, (max(diffs), sum(diffs) / len(diffs))
    assert sum(top_agree) / len(top_agree) > 0.95
