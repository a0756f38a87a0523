"""Shared pieces of the benchmarks: a fixed prompt corpus, timing helpers, environment notes, and
the transformers peer (imported lazily; transformers is a test-only dependency)."""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# A fixed, self-contained corpus (plain prose about ordinary things) so prompts are reproducible
# without any download. Prompts are windows of its token ids starting at different offsets, so no
# two prompts share a prefix and the prefix cache cannot turn the workload into a cache benchmark.
CORPUS = """\
The river rose slowly through the night, and by morning the lower fields were under a sheet of brown water.
Farmers walked the raised paths between the orchards, counting which trees would survive and which would not.
In the village the bakery opened at five as it always did, and the smell of bread drifted over the flooded lanes.
A lighthouse keeper on the northern coast kept a log of every ship that passed, written in a careful, narrow hand.
He noted the wind, the colour of the sea, the number of gulls on the rocks, and the time the lamp was lit.
Years later a historian found the logs in a cupboard and used them to reconstruct a century of weather.
Mathematics begins with counting, but it quickly becomes the study of patterns that nobody can see directly.
A prime number has no divisors other than one and itself, and there are infinitely many of them.
Euclid proved this more than two thousand years ago with an argument that still fits on a single page.
The old library had a reading room with a glass ceiling, so that on clear days no lamps were needed at all.
Students came in the afternoon and stayed until the light failed, then moved to the smaller rooms downstairs.
The librarian knew where every book was shelved, even the ones that the catalogue had long since forgotten.
To make a good soup, start with onions cooked gently in butter until they are soft and sweet but not brown.
Add carrots, celery and a little garlic, then the stock, and let everything simmer for at least an hour.
Season at the end, because the flavour concentrates as the liquid reduces and salt added early can overwhelm it.
The first mechanical clocks had no minute hand, since nobody yet needed to know the time that precisely.
Railways changed that: a timetable only works if every station agrees on what time it is.
Standard time zones followed, drawn first by railway companies and only later adopted by governments.
Bees communicate the direction of flowers by dancing, and the angle of the dance points relative to the sun.
A colony can decide where to build a new nest by a kind of vote, with scouts competing for support.
The process is slow and noisy, but it reliably picks the best site among the places the scouts have found.
When the bridge was finished the whole town turned out to walk across it, and a band played on the far bank.
The engineer who designed it stood apart from the crowd, watching the cables for any sign of movement.
It stood for ninety years before the first serious repairs, which were done without closing it to traffic.
Learning a language as an adult is hard mostly because we expect to understand everything at once.
Children tolerate confusion for months, listening and guessing, until the sounds start to carry meaning.
The most useful habit is to read a little every day, even when most of the words are still unfamiliar.
On the high plateau the nights are cold even in summer, and the stars are so many that they look like mist.
Shepherds there still move their flocks by the old routes, following the grass as the snow line retreats.
A small market appears each autumn where the routes meet, selling wool, cheese, salt and news.
Computers store numbers in binary, and a floating point number is a compromise between range and precision.
Adding a very small number to a very large one can leave the large one unchanged, which surprises people.
Careful programs add the small numbers first, or keep a running correction for the digits that were lost.
The garden was planted by someone who loved the colour blue: there were irises, cornflowers and delphiniums.
Every spring the new owners found another bulb they had not known about pushing up through the lawn.
They left the beds as they were and added only a bench, placed where the morning sun reached first.
"""


def corpus_prompts(encode, num_prompts: int, prompt_len: int, *, stride: int = 37) -> list[list[int]]:
    """`num_prompts` prompts of exactly `prompt_len` token ids: cyclic windows of the encoded corpus
    at offsets `i * stride`, so every prompt starts differently."""
    ids = list(encode(CORPUS))
    if len(ids) < 2:
        raise ValueError("the corpus encodes to fewer than 2 tokens")
    out = []
    for i in range(num_prompts):
        off = (i * stride) % len(ids)
        window = (ids[off:] + ids * (prompt_len // len(ids) + 1))[:prompt_len]
        out.append(window)
    return out


def random_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    """Warm-up prompts: random ids, so they never share a prefix with the measured prompts."""
    rng = random.Random(seed)
    lo = min(100, vocab_size - 1)
    return [rng.randrange(lo, vocab_size) for _ in range(n)]


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def percentiles(values: list[float], qs=(50, 95, 99)) -> dict[str, float]:
    """Nearest-rank percentiles, plus mean and max; empty input gives zeros."""
    if not values:
        return {**{f"p{q}": 0.0 for q in qs}, "mean": 0.0, "max": 0.0}
    s = sorted(values)
    out = {f"p{q}": s[min(len(s) - 1, max(0, -(-q * len(s) // 100) - 1))] for q in qs}
    out["mean"] = statistics.fmean(s)
    out["max"] = s[-1]
    return out


def set_threads(n: int | None) -> None:
    """--threads of a benchmark: the process-wide count (the compiled core's pool and torch's share,
    tokenmill/cpu_threads.py), which the engines built after it keep; None or 0 leaves the default."""
    if n:
        from tokenmill.cpu_threads import configure_threads

        configure_threads(n)


SIMD_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "amx_int8", "avx2", "fma",
              "f16c")


def _cpuinfo(key: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), "")
    except OSError:
        return ""


def cpu_flags(wanted: tuple[str, ...] = SIMD_FLAGS) -> str:
    """The SIMD flags of this CPU that matter to the kernels (from /proc/cpuinfo; empty elsewhere)."""
    have = _cpuinfo("flags").split()
    return " ".join(x for x in wanted if x in have)


def cpu_model() -> str:
    return _cpuinfo("model name") or "?"


def _kernels() -> str:
    from tokenmill.kernels import native

    return f"{native.variant()}+amx" if native.amx() else native.variant()


def huge_pages_state() -> str:
    """Whether gguf weights go into transparent huge pages here (kernels/huge_pages.py), and the
    system's THP setting: a one-row decode step runs 15-25% faster with them."""
    from tokenmill.kernels import huge_pages

    return f"{'weights' if huge_pages.wanted() else 'off'} (transparent_hugepage: {huge_pages.thp_mode()})"


def environment() -> dict[str, Any]:
    import torch

    from tokenmill.cpu_threads import describe as describe_threads

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "threads": describe_threads(),  # the compiled core's count and why (cpu_threads.py)
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "kernels": _kernels(),
        "huge_pages": huge_pages_state(),
    }
    try:
        from importlib.metadata import version

        env["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001 - not installed: the HF side is then skipped anyway
        env["transformers"] = None
    return env


def resolve_bench_device(name: str) -> str:
    """A benchmark's --device: auto is cuda when torch sees a GPU, else cpu; cuda without one exits
    with the reason (before anything is loaded)."""
    if name == "cpu":
        return name
    from tokenmill.model.gpu.device import DeviceUnavailable, resolve_device

    try:
        return resolve_device(name).type
    except DeviceUnavailable as exc:
        raise SystemExit(f"--device {name}: {exc}") from None


def progress(msg: str) -> None:
    """A progress note on stderr (the report itself goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg} (loadavg {loadavg()})", file=sys.stderr, flush=True)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


def fmt(x: float | None, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


# --- the transformers peer ---------------------------------------------------------------------
HF_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def load_hf(gguf_path: str | Path, dtype: str, device: str = "cpu", attn: str | None = None):
    """(model, seconds) for the same GGUF through transformers, in `dtype`, eval mode, on `device`;
    `attn`: its attn_implementation (None: transformers' default)."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:  # its GGUF loader draws a tqdm bar regardless of the settings above; keep the report readable
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.tqdm = lambda iterable, *a, **k: iterable
    except (ImportError, AttributeError):
        pass
    path = Path(gguf_path)
    start = time.perf_counter()
    more = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, HF_DTYPES[dtype]), **more)
    model.to(device).eval()
    return model, time.perf_counter() - start


class TimingStreamer:
    """A transformers streamer that only notes when each batch of tokens arrives. generate() calls
    put() once with the prompt and then once per generated position."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:  # noqa: ARG002
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int) -> dict[str, float]:
    """One batched greedy generate over `prompts` (left-padded), EOS ignored via min_new_tokens.
    Returns wall seconds, seconds to the first generated token, and the number of new tokens."""
    import torch

    from tokenmill.cpu_threads import torch_does_the_work

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    streamer = TimingStreamer()
    start = time.perf_counter()
    # transformers runs in torch: the full thread count, even beside an engine that gives torch one
    with torch.inference_mode(), torch_does_the_work():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id,
                             streamer=streamer)
    end = time.perf_counter()
    new = int(out.shape[1] - width) * len(prompts)
    first = streamer.times[1] if len(streamer.times) > 1 else end
    last = streamer.times[-1] if len(streamer.times) > 1 else end
    return {"seconds": end - start, "first_token_s": first - start, "last_token_s": last - start,
            "new_tokens": new, "steps": len(streamer.times) - 1}


def hf_pad_id(model) -> int:
    gc = model.generation_config
    for v in (gc.pad_token_id, gc.eos_token_id, model.config.eos_token_id, 0):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0
