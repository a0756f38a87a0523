"""A model's quantized weights are repacked after its tensors are read, in parallel and straight into
the huge-page arena (model/quantized.py packed_together / pack_all): the same bytes as packing each one
at once, every weight of the model packed, and QuantizedParts made elsewhere meanwhile unaffected."""
from __future__ import annotations

import threading

import gguf
import numpy as np
import torch
from gguf import quants

from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.kernels import huge_pages, qmatmul
from tokenmill.kernels.huge_pages import HugePageArena
from tokenmill.model import load_model
from tokenmill.model.linear import Linear
from tokenmill.model.quantized import QuantizedParts, RawTensor, pack_all, packed_together

Q = gguf.GGMLQuantizationType


def _raw(qtype: Q, rows: int, cols: int, seed: int) -> RawTensor:
    data = quants.quantize(np.random.default_rng(seed).normal(0, 1, (rows, cols)).astype(np.float32), qtype)
    return RawTensor(data, qtype, (rows, cols))


def _same(a: QuantizedParts, b: QuantizedParts) -> bool:
    return len(a.parts) == len(b.parts) and all(
        s1 == s2 and e1 == e2 and all(torch.equal(x, y) for x, y in zip((w1.qs, w1.sc, w1.sup), (w2.qs, w2.sc, w2.sup)))
        for (w1, s1, e1), (w2, s2, e2) in zip(a.parts, b.parts))


def test_waiting_parts_pack_in_parallel_to_the_same_bytes_and_into_the_arena():
    specs = [[_raw(Q.Q8_0, 48, 64, 1), _raw(Q.Q8_0, 16, 64, 2), _raw(Q.Q4_0, 32, 64, 3)], [_raw(Q.Q4_1, 32, 256, 4)],
             [_raw(Q.Q5_0, 16, 256, 5)], [_raw(Q.F16, 8, 64, 6)]]
    at_once = [QuantizedParts(parts) for parts in specs]
    assert all(q.parts for q in at_once)
    elsewhere: list[QuantizedParts] = []
    with packed_together() as waiting:
        later = [QuantizedParts(parts) for parts in specs]
        # Another thread's loads are not held back by this one's.
        t = threading.Thread(target=lambda: elsewhere.append(QuantizedParts(specs[0])))
        t.start()
        t.join()
    assert waiting == later and not any(q.parts for q in later) and elsewhere[0].parts
    assert [q.out_features for q in later] == [96, 32, 16, 8]
    arena, placed = HugePageArena(chunk_bytes=1 << 20), set()

    def place(t: torch.Tensor) -> torch.Tensor:
        out = arena.copy_of(t)
        placed.add(out.data_ptr())
        return out

    pack_all(waiting, workers=3, place=place)
    for a, b in zip(at_once[:3], later[:3]):
        assert _same(a, b)
    assert all(w.qs.data_ptr() in placed for q in later[:3] for w, _, _ in q.parts)
    assert torch.equal(later[3].parts[0][0], at_once[3].parts[0][0])  # F16: dequantized, as before


def test_a_loaded_model_has_every_weight_packed_and_computes_as_without_the_arena(tmp_path, monkeypatch):
    from model_helpers import prefill_logits

    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(weight_type=Q.Q8_0, tied_embeddings=False))
    monkeypatch.setattr(huge_pages, "wanted", lambda: False)
    plain = load_model(path, "gguf").model
    monkeypatch.setattr(huge_pages, "wanted", lambda: True)
    model = load_model(path, "gguf").model
    packed = [m.quantized for m in model.modules() if isinstance(m, Linear)] + [model.head_quantized]
    assert len(packed) == 2 * 4 + 1 and all(q.is_blocks and q.parts for q in packed)
    assert all(isinstance(w, qmatmul.QuantizedWeight) for q in packed for w, _, _ in q.parts)
    prompt = list(range(5, 45))
    assert torch.equal(prefill_logits(model, prompt, paged=True), prefill_logits(plain, prompt, paged=True))
