"""Thread-count invariance: logits and greedy tokens are bitwise the same at 1, 2, 3 and 4 threads
(more threads than this machine's cores is as valid a setting as any), for one sequence and for a
batch, on the default settings (gguf weights on the native kernels and the native decoder step, f16
KV cache). The compiled core's thread pool splits work only where a row's arithmetic does not depend
on the split (csrc/thread_pool.h). And two engines stepping at once in one process (two models loaded
on demand) both finish with what each gives alone."""
from __future__ import annotations

import itertools
import threading

import gguf
import pytest
import torch

from engine_helpers import TEST_BLOCK_SIZE, run_one_at_a_time, run_to_completion
from model_helpers import BLOCK
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.kernels import native
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import ChunkSpec, load_model
from tokenmill.model.paged_batch import PagedBatch
from tokenmill.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
THREADS = (1, 2, 3, 4)
pytestmark = pytest.mark.skipif(native.module() is None, reason="native kernels not built")

# Wide enough that a decode step's matmuls and attention are split over threads, not run inline.
LLAMA = TinyLlamaSpec(dim=256, n_heads=8, n_kv_heads=2, ffn_dim=512, weight_type=Q.Q4_1, context_length=512)
GEMMA3 = TinyGemma3Spec(dim=256, ffn_dim=512, weight_type=Q.Q5_0, context_length=512)


@pytest.fixture
def at_threads():
    """Switch the process's threads (torch and native) inside a test; restored after."""
    saved = torch.get_num_threads()

    def switch(n: int) -> None:
        torch.set_num_threads(n)
        native.set_num_threads(n)

    yield switch
    switch(saved)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return load_model(write_tiny_llama(tmp_path_factory.mktemp("llama") / "t.gguf", LLAMA))


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return load_model(write_tiny_gemma3(tmp_path_factory.mktemp("gemma") / "g.gguf", tiny_spm_metadata(), GEMMA3))


_tokenizers: dict[int, Tokenizer] = {}


def make_engine(loaded, **cfg) -> LLMEngine:
    """engine_helpers.make_engine with the tokenizer built once per model (Gemma 3's takes seconds)."""
    tok = _tokenizers.get(id(loaded))
    if tok is None:
        tok = _tokenizers[id(loaded)] = Tokenizer.from_gguf_metadata(loaded.gguf.metadata)
    cfg.setdefault("block_size", TEST_BLOCK_SIZE)
    return LLMEngine(loaded, tok, EngineConfig(**cfg))


def _prompts(lengths: list[int], lo: int, hi: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def _logits(model, prompts: list[list[int]], decode_steps: int = 3) -> list[torch.Tensor]:
    """Each chunk's last-row logits (the rows that sample), step by step: each prompt prefilled in two
    chunks (the second chunks of all prompts in one step), then decode steps of every sequence
    together on fixed next tokens."""
    cfg = model.config
    per_seq = -(-(max(len(p) for p in prompts) + decode_steps) // BLOCK)
    kv = KVStorage(cfg.n_layers, per_seq * len(prompts), BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.float16)
    tables = [list(range(s, per_seq * len(prompts), len(prompts))) for s in range(len(prompts))]
    steps = [[(s, 0, len(p) // 2)] for s, p in enumerate(prompts)]
    steps.append([(s, len(p) // 2, len(p) - len(p) // 2) for s, p in enumerate(prompts)])
    steps += [[(s, len(p) + i, 1) for s, p in enumerate(prompts)] for i in range(decode_steps)]
    tokens = [p + [7 + i for i in range(decode_steps)] for p in prompts]
    out = []
    for step in steps:
        ids = [t for s, start, n in step for t in tokens[s][start:start + n]]
        positions = [p for _, start, n in step for p in range(start, start + n)]
        meta = PagedBatch.build([ChunkSpec(tables[s], start, n) for s, start, n in step], BLOCK)
        last_rows = torch.tensor(list(itertools.accumulate(n for _, _, n in step))) - 1
        out.append(model.logits(model(torch.tensor(ids), torch.tensor(positions), meta, kv), last_rows).clone())
    return out


def _assert_logits_thread_invariant(model, prompts, at_threads) -> None:
    runs = {}
    for n in THREADS:
        at_threads(n)
        native.reset_pool_stats()
        runs[n] = _logits(model, prompts)
        if n > 1:
            assert native.pool_stats()["regions"] > 0, "nothing ran on more than one thread"
    for n in THREADS[1:]:
        for i, (a, b) in enumerate(zip(runs[1], runs[n])):
            assert torch.equal(a, b), f"{n} threads, step {i}: max |diff| {float((a - b).abs().max())}"


def _assert_tokens_thread_invariant(loaded, prompts, at_threads, max_tokens: int = 8) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [(p, params) for p in prompts]
    runs = {}
    for n in THREADS:
        at_threads(n)
        alone = run_one_at_a_time(make_engine(loaded, max_total_tokens=8192, threads=n), reqs)
        together = run_to_completion(make_engine(loaded, max_total_tokens=8192, threads=n, n_batch=64), reqs)
        assert together == alone, f"{n} threads: batched differs from alone"
        runs[n] = alone
    assert all(runs[n] == runs[1] for n in THREADS[1:])


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma3"])
def test_tiny_models_logits_alone_and_batched(request, which, at_threads):
    model = request.getfixturevalue(which).model
    prompts = _prompts([150, 37, 90], 6, 260)
    _assert_logits_thread_invariant(model, prompts[:1], at_threads)
    _assert_logits_thread_invariant(model, prompts, at_threads)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma3"])
def test_tiny_models_greedy_tokens_alone_and_batched(request, which, at_threads):
    _assert_tokens_thread_invariant(request.getfixturevalue(which), _prompts([5, 120, 33, 70, 200], 6, 260),
                                    at_threads)


def test_two_engines_stepping_at_once_finish_as_they_do_alone(tiny_llama, tiny_gemma3, at_threads):
    at_threads(2)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    jobs = {name: (loaded, [(p, params) for p in _prompts([40, 90, 13, 120], 6, 260, seed=i)])
            for i, (name, loaded) in enumerate([("llama", tiny_llama), ("gemma3", tiny_gemma3)])}
    alone = {name: run_to_completion(make_engine(loaded, threads=2), reqs) for name, (loaded, reqs) in jobs.items()}

    engines = {name: make_engine(loaded, threads=2) for name, (loaded, _) in jobs.items()}
    together: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def drive(name: str) -> None:
        try:
            start.wait(timeout=30)
            together[name] = run_to_completion(engines[name], jobs[name][1])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "an engine hung while the other stepped"
    assert errors == []
    assert together == alone


REAL_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
               "movable metal type, oil-based inks and a wooden press into a system that could produce books quickly.")


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_models_logits_and_tokens_alone_and_batched(request, which, at_threads):
    loaded = load_model(request.getfixturevalue(f"{which}_path"))
    ids = make_engine(loaded).tokenizer.encode(REAL_PROMPT)
    prompts = [ids, ids[5:30], ids[12:]]
    _assert_logits_thread_invariant(loaded.model, prompts[:1], at_threads)
    _assert_logits_thread_invariant(loaded.model, prompts, at_threads)
    _assert_tokens_thread_invariant(loaded, prompts, at_threads, max_tokens=4)
