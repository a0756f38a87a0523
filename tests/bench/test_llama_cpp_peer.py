"""The llama.cpp peer of `tokenmill bench single-stream`, without llama.cpp: argument parsing, the clear
error when llama-cpp-python is missing, and the whole benchmark against a stand-in `llama_cpp` module
that records how it is driven (prompt once, then one token at a time, KV cleared per run).
The real package is a benchmark-only dependency, never installed in CI."""
from __future__ import annotations

import ctypes
import json
import sys
import types

import pytest

from tokenmill.bench import llama_cpp_peer
from tokenmill.bench.single_stream import parse_peers
from tokenmill.cli import main

FAKE_VOCAB = 50


class FakeLlama:
    """Enough of llama_cpp.Llama for the peer: eval appends to a context, the logits favour
    (last token + 1) so greedy decoding is predictable."""

    instances: list[FakeLlama] = []

    def __init__(self, model_path, **kwargs):
        self.kwargs = dict(kwargs, model_path=model_path)
        self.context: list[int] = []
        self.calls: list[tuple[str, int]] = []
        self.logits = (ctypes.c_float * FAKE_VOCAB)()
        self.ctx = self
        FakeLlama.instances.append(self)

    def n_vocab(self) -> int:
        return FAKE_VOCAB

    def reset(self) -> None:
        self.calls.append(("reset", 0))
        self.context = []

    def eval(self, tokens) -> None:
        tokens = list(tokens)
        assert len(self.context) + len(tokens) <= self.kwargs["n_ctx"]
        self.calls.append(("eval", len(tokens)))
        self.context += tokens
        for i in range(FAKE_VOCAB):
            self.logits[i] = 0.0
        self.logits[(tokens[-1] + 1) % FAKE_VOCAB] = 1.0

    def close(self) -> None:
        self.calls.append(("close", 0))

    # The real Llama keeps the evaluated ids and a count; eval() drops the KV cells from n_tokens on.
    @property
    def n_tokens(self) -> int:
        return len(self.context)

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        self.context = self.context[:n]

    @property
    def input_ids(self):
        import numpy as np

        return np.array(self.context + [0] * (self.kwargs["n_ctx"] - len(self.context)))


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    mod = types.ModuleType("llama_cpp")
    mod.__version__ = "0.0-fake"
    mod.Llama = FakeLlama
    mod.llama_get_logits_ith = lambda ctx, i: ctypes.cast(ctx.logits, ctypes.POINTER(ctypes.c_float))
    mod.llama_print_system_info = lambda: b"CPU : FAKE = 1 |"
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    FakeLlama.instances = []
    return mod


def test_parse_peers():
    assert parse_peers("transformers") == ["transformers"]
    assert parse_peers("transformers,llama-cpp") == ["transformers", "llama-cpp"]
    assert parse_peers("llama.cpp, hf,llama_cpp") == ["llama-cpp", "transformers"]
    assert parse_peers("transformers,llama-cpp", skip_hf=True) == ["llama-cpp"]
    assert parse_peers("none") == []
    with pytest.raises(SystemExit, match="unknown peer"):
        parse_peers("vllm")


def test_context_size_holds_prompt_and_warmup():
    assert llama_cpp_peer.context_size(7900, 64) == 8192  # the 8k-context SmolLM2 run fits its 8192
    assert llama_cpp_peer.context_size(100, 128) == 256
    assert llama_cpp_peer.context_size(300, 2) == 512  # the warm-up's 8 new tokens count too
    assert llama_cpp_peer.context_size(8000, 128) >= 8128


def test_missing_package_is_a_clear_error(monkeypatch, tiny_gguf):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(llama_cpp_peer.LlamaCppMissing, match="pip install llama-cpp-python"):
        llama_cpp_peer.import_llama_cpp()
    with pytest.raises(SystemExit, match="pip install llama-cpp-python"):
        main(["bench", "single-stream", "--model", str(tiny_gguf), "--peer", "llama-cpp", "--skip-tokenmill"])


def test_skip_tokenmill_needs_a_peer(tiny_gguf):
    with pytest.raises(SystemExit, match="nothing to measure"):
        main(["bench", "single-stream", "--model", str(tiny_gguf), "--peer", "none", "--skip-tokenmill"])


def test_greedy_drives_eval_like_the_engine(fake_llama_cpp):
    model = llama_cpp_peer.LlamaCppModel("x.gguf", threads=2, n_ctx=64)
    assert model.llm.kwargs["n_threads"] == model.llm.kwargs["n_threads_batch"] == 2
    assert model.llm.kwargs["n_batch"] == 512 and model.llm.kwargs["verbose"] is False
    g = model.greedy([3, 4, 5], 4)
    assert g.token_ids == [6, 7, 8, 9]  # argmax of the last position's logits, fed back
    assert len(g.token_times) == 4 and g.t0 <= g.token_times[0] <= g.token_times[-1]
    # prompt in one eval, then n - 1 single-token evals: the last token is never fed back
    assert model.llm.calls == [("reset", 0), ("eval", 3), ("eval", 1), ("eval", 1), ("eval", 1)]
    model.greedy([10], 2)
    assert model.llm.context == [10, 11]  # reset before each run: nothing carried over
    with pytest.raises(ValueError, match="exceed n_ctx"):
        model.greedy(list(range(60)), 8)


def test_greedy_never_picks_suppressed_ids(fake_llama_cpp):
    model = llama_cpp_peer.LlamaCppModel("x.gguf", threads=2, n_ctx=64)
    g = model.greedy([3], 3, suppress=[4, 6])
    assert g.token_ids[0] != 4 and 4 not in g.token_ids and 6 not in g.token_ids


def test_single_stream_with_llama_cpp_peer(fake_llama_cpp, tiny_gguf, tmp_path, capsys):
    out = tmp_path / "single.json"
    rc = main(["bench", "single-stream", "--model", str(tiny_gguf), "--peer", "transformers,llama-cpp", "--skip-hf",
               "--dtypes", "fp32", "--prompt-len", "10", "--max-tokens", "5", "--repeats", "3", "--threads", "2",
               "--max-total-tokens", "512", "--no-compile", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tm/llama.cpp" in printed and "FAKE = 1" in printed

    r = json.loads(out.read_text())
    assert r["config"]["peers"] == ["llama-cpp"]
    entry = r["runs"]["fp32"]
    assert entry["hf"] is None
    lc, tm = entry["llama_cpp"], entry["tokenmill"]
    assert lc["decode_tok_s"] > 0 and lc["prefill_tok_s"] > 0 and len(lc["decode_tok_s_runs"]) == 3
    assert lc["n_ctx"] >= 10 + 8 and lc["flash_attn"] is False
    ra = entry["ratio_tokenmill_over_llama_cpp"]
    assert ra["decode_tok_s"] > 0 and len(ra["decode_tok_s_pairs"]) == 3
    assert tm["decode_tok_s"] > 0

    (llm,) = FakeLlama.instances  # loaded once, with the thread budget for both pools
    assert llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == 2
    evals = [n for op, n in llm.calls if op == "eval"]
    assert evals == [10] + [1] * 7 + ([10] + [1] * 4) * 3  # warm-up (8 tokens), then 3 timed runs
    assert llm.calls[-1] == ("close", 0)


def test_llama_cpp_alone(fake_llama_cpp, tiny_gguf, tmp_path):
    out = tmp_path / "alone.json"
    rc = main(["bench", "single-stream", "--model", str(tiny_gguf), "--peer", "llama-cpp", "--skip-tokenmill",
               "--prompt-len", "600", "--max-tokens", "3", "--repeats", "1", "--json", str(out)])
    assert rc == 0
    (llm,) = FakeLlama.instances
    evals = [n for op, n in llm.calls if op == "eval"]
    assert evals == [512] + [1] * 7 + [600, 1, 1]  # the warm-up's prompt is capped, the timed one is not
    r = json.loads(out.read_text())
    assert list(r["runs"]) == ["gguf"]  # tokenmill's dtypes do not apply to llama.cpp alone
    assert r["runs"]["gguf"]["tokenmill"] is None and r["runs"]["gguf"]["llama_cpp"]["decode_tok_s"] > 0


def test_an_amx_build_on_an_amx_cpu_loads_without_extra_buffer_types(fake_llama_cpp, monkeypatch):
    # llama.cpp's AMX matmul (an extra buffer type) faults on the Xeons measured here: where the build
    # has it and the CPU has AMX, the peer loads without extra buffer types, says so, and leaves
    # llama-cpp-python's defaults as they were.
    class Params:
        use_extra_bufts = True

    low_level = types.SimpleNamespace(llama_model_default_params=Params)
    fake_llama_cpp.llama_cpp = low_level
    seen = []

    class RecordingLlama(FakeLlama):
        def __init__(self, model_path, **kwargs):
            seen.append(low_level.llama_model_default_params().use_extra_bufts)
            super().__init__(model_path, **kwargs)

    fake_llama_cpp.Llama = RecordingLlama
    import tokenmill.bench.common as common

    fake_llama_cpp.llama_print_system_info = lambda: b"CPU : AVX512 = 1 | AMX_INT8 = 1 |"
    monkeypatch.setattr(common, "cpu_flags", lambda: "avx512f amx_int8")
    model = llama_cpp_peer.LlamaCppModel("m.gguf", threads=2, n_ctx=256)
    assert seen == [False] and not model.extra_buffer_types
    assert "off" in llama_cpp_peer.describe()["extra_buffer_types"]
    assert low_level.llama_model_default_params is Params  # restored
    monkeypatch.setattr(common, "cpu_flags", lambda: "avx512f")  # no AMX on the CPU: left as they are
    model = llama_cpp_peer.LlamaCppModel("m.gguf", threads=2, n_ctx=256)
    assert seen == [False, True] and model.extra_buffer_types
    assert "extra_buffer_types" not in llama_cpp_peer.describe()


def test_greedy_continuing_reuses_the_longest_common_prefix(fake_llama_cpp):
    """A chat turn (bench chat): the context's common prefix with the new prompt stays, all but the
    prompt's last token at most; the rest is evaluated; decoding stops at a stop id."""
    model = llama_cpp_peer.LlamaCppModel("x.gguf", threads=2, n_ctx=64)
    g, reused = model.greedy_continuing([3, 4, 5], 5, stop_ids=[8])
    assert (g.token_ids, reused) == ([6, 7, 8], 0) and model.llm.context == [3, 4, 5, 6, 7]  # 8: never fed back
    model.llm.calls.clear()
    g, reused = model.greedy_continuing([3, 4, 5, 6, 9, 10], 2, stop_ids=[])
    assert (g.token_ids, reused) == ([11, 12], 4) and model.llm.calls == [("eval", 2), ("eval", 1)]
    g, reused = model.greedy_continuing([3, 4, 5, 6, 9, 10], 1, stop_ids=[])
    assert (g.token_ids, reused) == ([11], 5)  # the same prompt again: its last token is computed
    with pytest.raises(ValueError, match="exceed n_ctx"):
        model.greedy_continuing(list(range(60)), 8, stop_ids=[])
