"""`tokenmill bench scaling`: the whole benchmark on the tiny model (two thread counts, tiny sizes,
tokenmill alone), the parsers of llama.cpp's llama-bench and llama-batched-bench on their recorded
output, those binaries' runners against stand-in scripts, the batched llama-cpp-python driver against
a stand-in `llama_cpp` module, and the OpenMP fork-join shim's clean absence. No timing asserts."""
from __future__ import annotations

import ctypes
import json
import os
import stat
import sys
import types
from pathlib import Path

import pytest

from tokenmill.bench import gomp_shim, llama_cpp_batched
from tokenmill.bench.llama_cpp_tools import (ToolError, batched_bench_command, parse_batched_bench,
                                             parse_llama_bench_json, run_batched_bench, run_llama_bench)
from tokenmill.bench.scaling import default_thread_counts, parse_counts
from tokenmill.cli import main

DATA = Path(__file__).parent / "data"


# --- the whole benchmark ---------------------------------------------------------------------------

def test_scaling_bench_tiny(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "scaling.json"
    rc = main(["bench", "scaling", "--model", str(tiny_gguf), "--threads", "1,2", "--skip-llama-cpp",
               "--tg-tokens", "6", "--tg-prompt-len", "4", "--pp-tokens", "24", "--batch", "3",
               "--batch-prompt-len", "5", "--batch-tokens", "3", "--repeats", "1", "--timeout", "300",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for title in ("single-stream decode tok/s", "prefill tok/s", "3-sequence decode tok/s", "thread pool per"):
        assert title in printed

    r = json.loads(out.read_text())
    m = r["machine"]
    assert m["logical_cpus"] >= 1 and m["default_threads"] >= 1 and m["default_threads_reason"]
    assert isinstance(m["flags"], str) and m["cpu"]
    assert r["llama_cpp"]["tg_pp"] is None and r["llama_cpp"]["batch"] is None
    assert [row["threads"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        tm = row["tokenmill"]
        assert "error" not in tm, tm.get("error")
        assert tm["tg"]["decode_tok_s"] > 0 and len(tm["tg"]["runs"]) == 1
        assert tm["pp"]["prefill_tok_s"] > 0
        b = tm["batch"]
        assert b["decode_tok_s"] > 0 and b["steps"] == 3 and b["num_seqs"] == 3 and b["decode_step_ms"] > 0
        t, pb = tm["proxy_tg"], tm["proxy_batch"]
        assert t["tokens"] == 5 and pb["tokens"] == 3 * 3 and pb["steps"] == 3
        if "LD_PRELOAD shim built" in r["gomp_shim"]:  # gcc here: every fork-join was counted
            assert t["totals"]["gomp_fork_joins"] >= 0 and pb["totals"]["gomp_fork_joins"] >= 0
        if t["totals"]["regions"] is not None:  # a build with the pool's counters
            assert t["totals"]["regions"] >= 0 and t["totals"]["join_wait_ns"] >= 0
        assert row["ratio"] == {"tg": None, "pp": None, "batch": None}
        assert row["llama_cpp"] == {}

    # the saved result prints the same report
    assert main(["bench", "scaling", "--from-json", str(out)]) == 0
    assert capsys.readouterr().out.strip() == printed.strip()


def test_thread_counts():
    assert default_thread_counts(16) == [1, 2, 4, 8, 16]
    assert default_thread_counts(12) == [1, 2, 4, 8, 12]
    assert default_thread_counts(2) == [1, 2]
    assert default_thread_counts(1) == [1]
    assert parse_counts("default,16,8,default", 16) == [16, 8]
    assert parse_counts("4, 2", 16) == [4, 2]
    for bad in ("", "0", "two", "1,-2"):
        with pytest.raises(SystemExit):
            parse_counts(bad, 4)


def test_bad_llama_binary_is_a_clear_error(tiny_gguf, tmp_path):
    not_exe = tmp_path / "llama-bench"
    not_exe.write_text("")
    with pytest.raises(SystemExit, match="not an executable"):
        main(["bench", "scaling", "--model", str(tiny_gguf), "--threads", "1", "--llama-bench", str(not_exe)])


# --- llama-bench and llama-batched-bench output ----------------------------------------------------

def test_parse_llama_bench_json_recorded():
    figures = parse_llama_bench_json((DATA / "llama_bench.json").read_text())
    tests = {(f.n_threads, f.test): f for f in figures}
    assert set(tests) == {(1, "pp64"), (1, "tg16"), (2, "pp64"), (2, "tg16")}
    assert all(f.avg_ts > 0 and f.stddev_ts >= 0 for f in figures)


def test_parse_llama_bench_jsonl_and_garbage():
    row = {"n_threads": 4, "n_prompt": 512, "n_gen": 0, "avg_ts": 2899.5, "stddev_ts": 12.0}
    jsonl = json.dumps(row) + "\n" + json.dumps({**row, "n_prompt": 0, "n_gen": 128, "avg_ts": 377.4}) + "\n"
    figures = parse_llama_bench_json(jsonl)
    assert [(f.test, f.avg_ts) for f in figures] == [("pp512", 2899.5), ("tg128", 377.4)]
    for bad in ("", "main: error: failed to load model", "[\n  {\"n_threads\": 1}\n]"):
        with pytest.raises(ToolError):
            parse_llama_bench_json(bad)


def test_parse_batched_bench_recorded_table():
    rows = parse_batched_bench((DATA / "llama_batched_bench.txt").read_text())
    assert [(r.pp, r.tg, r.pl) for r in rows] == [(8, 4, 4)]
    assert rows[0].s_tg > 0 and rows[0].s_pp > 0


def test_parse_batched_bench_jsonl_and_empty():
    line = ('{"n_kv_max": 14592, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
            '"n_gpu_layers": -1, "n_threads": 16, "n_threads_batch": 16, "pp": 100, "tg": 128, "pl": 64, '
            '"n_kv": 14592, "t_pp": 2.2, "speed_pp": 2909.1, "t_tg": 6.5, "speed_tg": 1253.0, "t": 8.7, '
            '"speed": 1677.2}')
    rows = parse_batched_bench("llama_model_loader: ...\n" + line + "\n")
    assert [(r.pl, r.s_tg, r.s_pp) for r in rows] == [(64, 1253.0, 2909.1)]
    # a table whose only row was skipped (context too small) has a header and no rows
    header = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
    with pytest.raises(ToolError, match="no result rows"):
        parse_batched_bench(header + "\n|-------|--------|------|--------|----------|----------|\n")


def test_batched_bench_context_fits_the_row():
    cmd = batched_bench_command("llama-batched-bench", "m.gguf", 16, 64, 100, 128)
    n_ctx = int(cmd[cmd.index("-c") + 1])
    assert n_ctx >= 64 * (100 + 128) and cmd[cmd.index("-npl") + 1] == "64" and cmd[cmd.index("-t") + 1] == "16"


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_runners_against_stand_in_binaries(tmp_path):
    bench = _script(tmp_path / "llama-bench", f"cat {DATA / 'llama_bench.json'}\n")
    r = run_llama_bench(bench, "m.gguf", 2, 64, 16, 1, timeout=30)
    assert r["source"] == "llama-bench" and r["tg_tok_s"] > 0 and r["pp_tok_s"] > 0
    one = run_llama_bench(bench, "m.gguf", 1, 64, 16, 1, timeout=30)
    assert one["tg_tok_s"] != r["tg_tok_s"]  # each thread count's own row

    batched = _script(tmp_path / "llama-batched-bench", f"cat {DATA / 'llama_batched_bench.txt'} >&2\n")
    b = run_batched_bench(batched, "m.gguf", 2, 4, 8, 4, timeout=30)
    assert b["batch_tok_s"] > 0 and "-npl 4" in b["command"]
    with pytest.raises(ToolError, match="no row for 64"):
        run_batched_bench(batched, "m.gguf", 2, 64, 8, 4, timeout=30)

    failing = _script(tmp_path / "broken", "echo 'error: unable to load model' >&2\nexit 1\n")
    with pytest.raises(ToolError, match="exited with 1.*unable to load model"):
        run_llama_bench(failing, "m.gguf", 1, 64, 16, 1, timeout=30)
    slow = _script(tmp_path / "slow", "sleep 5\n")
    with pytest.raises(ToolError, match="timed out"):
        run_batched_bench(slow, "m.gguf", 1, 4, 8, 4, timeout=0.5)
    with pytest.raises(ToolError, match="could not start"):
        run_llama_bench(str(tmp_path / "missing"), "m.gguf", 1, 64, 16, 1, timeout=30)


# --- the batched llama-cpp-python driver, against a stand-in llama_cpp ----------------------------

VOCAB = 40


class _Ctx:
    def __init__(self, params):
        self.params = params
        self.kv: dict[int, list[int]] = {}
        self.logits = (ctypes.c_float * 1)()
        self.decodes: list[list[tuple[int, int, int, bool]]] = []


def _fake_llama_cpp(system_info: bytes = b"AVX2 = 1 | AVX512 = 1") -> types.ModuleType:
    """Enough of llama_cpp's low-level API: positions must extend each sequence's cache, and the logits
    of an output row favour (its token + 1), so greedy decoding is predictable."""
    m = types.ModuleType("llama_cpp")
    m.llama_backend_init = lambda: None
    m.llama_print_system_info = lambda: system_info
    m.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)
    m.llama_model_load_from_file = lambda path, params: {"path": path, "params": params}
    m.llama_context_default_params = lambda: types.SimpleNamespace()
    m.llama_init_from_model = lambda model, params: _Ctx(params)
    m.llama_model_get_vocab = lambda model: "vocab"
    m.llama_vocab_n_tokens = lambda vocab: VOCAB

    def batch_init(n, embd, n_seq_max):
        ints = lambda: (ctypes.c_int32 * n)()  # noqa: E731
        return types.SimpleNamespace(n_tokens=0, token=ints(), pos=ints(), n_seq_id=ints(),
                                     seq_id=[(ctypes.c_int32 * n_seq_max)() for _ in range(n)],
                                     logits=(ctypes.c_int8 * n)())

    def decode(ctx, b):
        rows = [(b.token[i], b.pos[i], b.seq_id[i][0], bool(b.logits[i])) for i in range(b.n_tokens)]
        outputs = [r for r in rows if r[3]]
        ctx.logits = (ctypes.c_float * (max(1, len(outputs)) * VOCAB))()
        for k, (tok, pos, seq, _) in enumerate(outputs):
            ctx.logits[k * VOCAB + (tok + 1) % VOCAB] = 1.0
        for tok, pos, seq, _ in rows:
            cache = ctx.kv.setdefault(seq, [])
            assert pos == len(cache), f"sequence {seq}: position {pos} after {len(cache)} cached"
            cache.append(tok)
        ctx.decodes.append(rows)
        return 0

    m.llama_batch_init = batch_init
    m.llama_decode = decode
    m.llama_get_logits = lambda ctx: ctypes.cast(ctx.logits, ctypes.POINTER(ctypes.c_float))
    m.llama_get_memory = lambda ctx: ctx
    m.llama_memory_clear = lambda mem, data: mem.kv.clear()
    m.llama_batch_free = m.llama_free = m.llama_model_free = lambda x: None
    return m


def test_batched_llama_cpp_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_llama_cpp())
    b = llama_cpp_batched.LlamaCppBatched("m.gguf", threads=3, num_seqs=3, max_len=12, n_batch=4)
    assert b.model["params"].use_extra_bufts  # llama.cpp's defaults, where nothing faults
    assert b.ctx.params.n_seq_max == 3 and b.ctx.params.n_threads == b.ctx.params.n_threads_batch == 3
    assert b.ctx.params.n_ctx >= 3 * 12
    prompts = [[1, 2, 3], [10, 11], [20, 21, 22, 23]]
    run = b.run(prompts, decode_steps=4)
    assert run.decode_steps == 4 and run.num_seqs == 3 and run.decode_tok_s > 0
    prefill, steps = b.ctx.decodes[:3], b.ctx.decodes[3:]
    assert [len(d) for d in prefill] == [4, 4, 1]  # 9 prompt tokens in chunks of n_batch=4
    assert len(steps) == 4 and all(len(s) == 3 for s in steps)
    # greedy: each sequence continues with (its last token + 1), one position further each step
    for seq, p in enumerate(prompts):
        assert b.ctx.kv[seq] == p + [p[-1] + 1 + i for i in range(4)]
    b.run(prompts, decode_steps=1)  # the memory is cleared between runs: positions start again
    assert b.ctx.kv[0] == prompts[0] + [4]
    with pytest.raises(ValueError):
        b.run(prompts[:2], decode_steps=1)
    b.close()


def test_batched_llama_cpp_loads_an_amx_build_without_extra_buffer_types_on_an_amx_cpu(monkeypatch):
    """As the single-sequence peer: that build's AMX matmul faults at its first tile load here."""
    from tokenmill.bench import common

    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_llama_cpp(b"AVX512 = 1 | AMX_INT8 = 1"))
    monkeypatch.setattr(common, "cpu_flags", lambda: {"avx512f", "amx_int8"})
    b = llama_cpp_batched.LlamaCppBatched("m.gguf", threads=1, num_seqs=2, max_len=8)
    assert b.model["params"].use_extra_bufts is False
    b.close()


# --- the fork-join counter ------------------------------------------------------------------------

def test_gomp_shim_absent_is_clean(tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no cc
    shim = gomp_shim.build_shim(tmp_path / "shim")
    assert not shim.available and "no C compiler" in shim.reason
    env = gomp_shim.preload_env(shim, {"LD_PRELOAD": "", "X": "1"})
    assert gomp_shim.ENV_VAR not in env and env["LD_PRELOAD"] == ""
    broken = _script(tmp_path / "cc", "echo 'cc: fatal error: no input' >&2\nexit 1\n")
    shim = gomp_shim.build_shim(tmp_path / "shim2", compiler=broken)
    assert not shim.available and "fatal error" in shim.reason
    assert gomp_shim.read_count() is None  # this process was not started with it


@pytest.mark.skipif(not (os.path.exists("/usr/bin/gcc") or os.environ.get("CC")), reason="no C compiler")
def test_gomp_shim_counts_fork_joins(tmp_path):
    import subprocess

    shim = gomp_shim.build_shim(tmp_path)
    if not shim.available:
        pytest.skip(shim.reason)
    env = gomp_shim.preload_env(shim)
    assert env["LD_PRELOAD"].startswith(shim.path)
    # three OpenMP regions, and the shim's counter read through the process's global symbols
    prog = tmp_path / "omp.c"
    prog.write_text(
        "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <stdio.h>\n"
        "int main(void) {\n"
        "  unsigned long (*count)(void) =\n"
        f"    (unsigned long (*)(void))dlsym(RTLD_DEFAULT, \"{gomp_shim.COUNT_SYMBOL}\");\n"
        "  if (!count) { puts(\"none\"); return 0; }\n"
        "  unsigned long before = count(); int n = 0;\n"
        "  for (int i = 0; i < 3; i++) {\n#pragma omp parallel num_threads(2)\n"
        "    {\n#pragma omp atomic\n      n++;\n    }\n  }\n"
        "  printf(\"%lu %d\\n\", count() - before, n);\n  return 0;\n}\n")
    exe = tmp_path / "omp"
    subprocess.run(["gcc", "-fopenmp", "-o", str(exe), str(prog), "-ldl"], check=True, capture_output=True)
    assert subprocess.run([str(exe)], capture_output=True, text=True).stdout.strip() == "none"
    done = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "6"]  # every region counted, and each ran on its 2 threads
