"""The engine on a CUDA GPU (skipped without one): weights dequantized on the device, the KV cache
sized from free memory, decode steps replayed from CUDA graphs, sampling on the device. Held to the
CPU bf16 engine on the same tiny models (greedy tokens equal, logits within bf16 tolerance) and the
graphs to the eager device steps."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import make_engine, random_ids, run_to_completion
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.engine import SamplingParams
from tokenmill.engine.config import ConfigError
from tokenmill.engine.gpu_runner import DeviceModelRunner
from tokenmill.model import load_model
from tokenmill.model.gpu.buckets import decode_buckets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = [5, 40, 17, 3, 29, 64, 9, 33]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def per_request(runner) -> dict[str, list[torch.Tensor]]:
    """Each request's logits rows, step by step (requests with one sample each); a CPU runner is made to
    give logits, not greedy tokens."""
    rows: dict[str, list[torch.Tensor]] = {}
    run = runner.run
    runner.picks_greedy_tokens = False

    def wrapped(batch):
        out = run(batch)
        if out.logits is not None:
            for chunk, row in zip(batch.sampling_chunks, out.logits.float().cpu()):
                rows.setdefault(chunk.seq.request_id, []).append(row)
        return out

    runner.run = wrapped
    return rows


def assert_same_greedy(expected: list[list[int]], got: list[list[int]], ref_rows: list[list[torch.Tensor]],
                       got_rows: list[list[torch.Tensor]], tolerance: float = 0.03) -> None:
    """Greedy tokens equal, logits within bf16 tolerance; two bf16 models that round their matmuls
    differently may part at a near tie, so a request's tokens may differ from the first step whose two
    candidates the reference scores within two thirds of the logit tolerance of each other (2% of its
    largest logit for the Llama models' 3%; Gemma 3's larger activations get 6% and 4%), and from
    there on, not before."""
    for want, have, ref, ours in zip(expected, got, ref_rows, got_rows):
        for step, (a, b) in enumerate(zip(want, have)):
            scale = float(ref[step].abs().max())
            assert float((ref[step] - ours[step]).abs().max()) < tolerance * scale, step
            if a != b:
                assert float(ref[step][a] - ref[step][b]) < tolerance * 2 / 3 * scale, (step, a, b)
                break


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cuda-llama") / "t.gguf", TinyLlamaSpec(context_length=512))


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("cuda-gemma") / "g.gguf", tiny_spm_metadata(),
                             TinyGemma3Spec(context_length=512))


def against_cpu(path, prompts, *, compile: bool, tolerance: float = 0.03, **cfg):
    reqs = [(p, GREEDY) for p in prompts]
    cpu = make_engine(load_model(path, torch.bfloat16), **cfg)  # eager: CUDA graphs are the GPU's compile
    # One step at a time: the logits of decode steps in a row never leave the device (see below).
    gpu = make_engine(load_model(path, "auto", device="cuda"), device="cuda", compile=compile, decode_steps=1, **cfg)
    assert isinstance(gpu.runner, DeviceModelRunner) and gpu.kv.k[0].is_cuda
    cpu_rows, gpu_rows = per_request(cpu.runner), per_request(gpu.runner)
    expected, got = run_to_completion(cpu, reqs), run_to_completion(gpu, reqs)
    ids = [f"req-{i}" for i in range(len(reqs))]
    assert_same_greedy(expected, got, [cpu_rows[i] for i in ids], [gpu_rows[i] for i in ids], tolerance)
    return gpu


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graphs"])
def test_llama_on_cuda_matches_the_cpu(llama_path, compile):
    prompts = [random_ids(n, seed=i) for i, n in enumerate(LENGTHS)]
    gpu = against_cpu(llama_path, prompts, n_batch=64, n_ubatch=32, parallel=8, max_total_tokens=4096,
                      compile=compile)
    if compile:
        assert gpu.runner.graphs.buckets == decode_buckets(8)
        assert gpu.runner.graph_steps > 0
    else:
        assert gpu.runner.graphs is None


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graphs"])
def test_gemma3_on_cuda_matches_the_cpu(gemma3_path, compile):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 260, (n,), generator=g).tolist() for n in LENGTHS]
    # The tiny Gemma's logits are small (largest ~1.7) and pass four norms a layer: on an H200 its
    # steps stayed within 4.3% of the largest logit of the CPU's bf16 path (0.074 of 1.71, step 8).
    against_cpu(gemma3_path, prompts, n_batch=64, n_ubatch=32, parallel=8, max_total_tokens=4096, compile=compile,
                tolerance=0.06)


def test_graphs_replay_what_eager_steps_compute(llama_path):
    loaded = load_model(llama_path, "auto", device="cuda")
    reqs = [(random_ids(n, seed=i), GREEDY) for i, n in enumerate(LENGTHS[:5])]  # 5 rows: the bucket of 8
    eager = make_engine(loaded, device="cuda", parallel=8, max_total_tokens=4096, decode_steps=1)
    graphs = make_engine(loaded, device="cuda", parallel=8, max_total_tokens=4096, compile=True, decode_steps=1)
    eager_rows, graph_rows = per_request(eager.runner), per_request(graphs.runner)
    expected, got = run_to_completion(eager, reqs), run_to_completion(graphs, reqs)
    assert graphs.runner.graph_steps > 0
    ids = [f"req-{i}" for i in range(len(reqs))]
    assert_same_greedy(expected, got, [eager_rows[i] for i in ids], [graph_rows[i] for i in ids])


def test_decode_steps_in_a_row_on_cuda_give_the_single_steps_tokens(llama_path):
    """The default on a GPU: decode-only batches run 4 graph replays in a row, each row's next input
    its sampled token on the device. The same tokens as one step at a time, a seeded sample's and a
    penalised row's (its window sliding inside the runs) too."""
    loaded = load_model(llama_path, "auto", device="cuda")
    reqs = [(random_ids(n, seed=i), SamplingParams(max_tokens=11, temperature=0, ignore_eos=True))
            for i, n in enumerate(LENGTHS[:4])]
    reqs.append((random_ids(12, seed=9), SamplingParams(max_tokens=11, temperature=0.9, seed=3, ignore_eos=True)))
    reqs.append((random_ids(10, seed=8), SamplingParams(max_tokens=11, temperature=0, repeat_penalty=1.3,
                                                        repeat_last_n=3, ignore_eos=True)))
    single = make_engine(loaded, device="cuda", parallel=8, max_total_tokens=4096, compile=True, decode_steps=1)
    several = make_engine(loaded, device="cuda", parallel=8, max_total_tokens=4096, compile=True)
    assert several.decode_steps == 4
    expected = run_to_completion(single, reqs)
    assert run_to_completion(several, reqs) == expected
    # 10 decode tokens each: 10 engine steps one at a time, 3 in runs (4 + 4 + 2), every one replayed
    assert several.stats.num_steps < single.stats.num_steps
    assert several.runner.graph_steps == single.runner.graph_steps


def test_seeded_sampling_repeats_on_cuda(llama_path):
    loaded = load_model(llama_path, "auto", device="cuda")
    # No prefix cache: the second run computes its prompt as the first did.
    engine = make_engine(loaded, device="cuda", parallel=8, max_total_tokens=4096, compile=True,
                         enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1,
                             repeat_penalty=1.2, logprobs=True, top_logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True)]
    first = run_to_completion(engine, [(random_ids(20, seed=7), p) for p in params])
    again = run_to_completion(engine, [(random_ids(20, seed=7), p) for p in params])
    assert first == again and all(len(out) == 8 for out in first)  # seeds repeat on the device


def test_kv_cache_on_the_gpu(llama_path):
    loaded = load_model(llama_path, "auto", device="cuda")
    engine = make_engine(loaded, device="cuda", max_total_tokens=4096)
    assert engine.cfg.max_total_tokens == 4096  # room for more: kv_size caps it
    assert engine.kv.k[0].dtype == torch.bfloat16 and engine.kv.k[0].shape[1] == 4096
    assert engine.runner.kv_bytes == engine.kv.nbytes and engine.runner.weights_bytes > 0
    assert engine.runner.device_name == torch.cuda.get_device_name()
    with pytest.raises(ConfigError, match="not enough GPU memory"):
        make_engine(loaded, device="cuda", gpu_memory_utilization=0.001)
