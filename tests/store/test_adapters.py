"""Models made with LoRA adapters (store/adapters.py, save_derived's `adapters`): the adapters are blobs,
the merged weights a blob of their own that the model resolves to, deriving from such a model keeps
them, and removing the last model that uses a blob removes it; an adapter is never a model, nor a model
an adapter, and a refused merge leaves nothing behind."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_lora import write_lora, write_updated
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.gguf.reader import open_gguf
from tokenmill.gguf.weights import dequantize
from tokenmill.store import StoreError
from tokenmill.store.blobs import InvalidBlobError, adapter_blob, blob_path, blobs_dir, import_file, model_blob
from tokenmill.store.derived import Profile, find_derived, save_derived
from tokenmill.store.local import models_dir
from tokenmill.store.names import copy_model, delete_model, resolve_named


@pytest.fixture
def files(home, tmp_path):
    models = models_dir()
    models.mkdir(parents=True, exist_ok=True)
    base = write_tiny_llama(models / "tiny-a.gguf")
    updates = write_lora(tmp_path / "lora.gguf", base, rank=2)
    return base, tmp_path / "lora.gguf", updates


def _blobs() -> list[str]:
    return sorted(p.name for p in blobs_dir().iterdir()
                  if p.name.startswith("sha256-") and not p.name.endswith(".json"))


def test_a_model_with_an_adapter_resolves_to_the_merged_weights(files, tmp_path):
    base, lora, updates = files
    adapter = import_file(lora, kind="adapter")
    made = save_derived("tuned", "tiny-a", Profile(system="be brief"), (f"sha256:{adapter}",))
    assert made.adapters == (f"sha256:{adapter}",) and made.adapted_from == "tiny-a"
    resolved = resolve_named("tuned")
    assert resolved.path != base and resolved.profile.system == "be brief"
    merged, g = open_gguf(resolved.path), open_gguf(base)
    for name, update in updates.items():
        want = dequantize(g.tensors[name], torch.float64).numpy() + update
        np.testing.assert_allclose(dequantize(merged.tensors[name], torch.float64).numpy(), want, atol=1e-5)
    # Derived again (and copied) it keeps the merged weights and says which adapters they hold.
    save_derived("tuned-cold", "tuned", Profile(parameters={"temperature": 0.0}))
    copy_model("tuned", "tuned-copy")
    for name in ("tuned-cold", "tuned-copy"):
        d = find_derived(name)
        assert (d.base, d.adapters, d.adapted_from) == (made.base, made.adapters, "tiny-a"), name
    assert find_derived("tuned-cold").profile.system == "be brief"
    assert len(_blobs()) == 2  # the adapter and the merged model
    for name in ("tuned", "tuned-cold"):
        delete_model(name)
        assert len(_blobs()) == 2  # tuned-copy still uses both
    delete_model("tuned-copy")
    assert _blobs() == [] and base.exists()


def test_adapters_stack_in_order_on_a_derived_base(files, tmp_path):
    base, lora, first = files
    second = write_lora(tmp_path / "second.gguf", base, ("blk.1.ffn_down.weight",), rank=3, seed=5)
    a, b = import_file(lora, kind="adapter"), import_file(tmp_path / "second.gguf", kind="adapter")
    save_derived("one", "tiny-a", Profile(), (f"sha256:{a}",))
    save_derived("two", "one", Profile(), (f"sha256:{b}",))
    d = find_derived("two")
    assert d.adapters == (f"sha256:{a}", f"sha256:{b}") and d.adapted_from == "tiny-a"
    write_updated(tmp_path / "ref.gguf", base, {k: first.get(k, 0) + second.get(k, 0) for k in {*first, *second}})
    merged, ref = open_gguf(resolve_named("two").path), open_gguf(tmp_path / "ref.gguf")
    for name in ref.tensors:
        np.testing.assert_allclose(np.asarray(merged.tensors[name].data), np.asarray(ref.tensors[name].data),
                                   atol=1e-5, err_msg=name)


def test_adapters_and_models_are_not_each_other(files, tmp_path):
    base, lora, _ = files
    adapter, model = import_file(lora, kind="adapter"), import_file(base)
    with pytest.raises(InvalidBlobError, match="is a LoRA adapter, not a model"):
        model_blob(adapter)
    with pytest.raises(InvalidBlobError, match="is a model, not a LoRA adapter"):
        adapter_blob(model)
    with pytest.raises(StoreError, match="is a LoRA adapter, not a model"):
        save_derived("x", f"sha256:{adapter}", Profile())
    with pytest.raises(StoreError, match="is a model, not a LoRA adapter"):
        save_derived("x", "tiny-a", Profile(), (f"sha256:{model}",))
    assert find_derived("x") is None


def test_a_refused_merge_leaves_nothing(files, tmp_path):
    base, _, _ = files
    other = write_tiny_llama(tmp_path / "wide.gguf", TinyLlamaSpec(dim=96, ffn_dim=160))
    write_lora(tmp_path / "wide-lora.gguf", other, ("blk.0.attn_q.weight",))
    adapter = import_file(tmp_path / "wide-lora.gguf", kind="adapter")
    before = _blobs()
    with pytest.raises(StoreError) as err:
        save_derived("x", "tiny-a", Profile(), (f"sha256:{adapter}",))
    assert "adapter 1" in str(err.value) and "96 x 96" in str(err.value)
    assert str(models_dir()) not in str(err.value) and str(tmp_path) not in str(err.value)
    assert find_derived("x") is None and _blobs() == before
    with pytest.raises(StoreError, match="not found"):
        save_derived("x", "tiny-a", Profile(), ("sha256:" + "0" * 64,))
    assert not any(p.name.startswith(".upload-") for p in blobs_dir().iterdir())
    assert blob_path(adapter).exists()


def test_importing_a_file_as_the_wrong_kind_keeps_nothing(files):
    base, lora, _ = files
    with pytest.raises(InvalidBlobError, match="is a model, not a LoRA adapter"):
        import_file(base, kind="adapter")
    with pytest.raises(InvalidBlobError, match="is a LoRA adapter, not a model"):
        import_file(lora)
    assert _blobs() == []


def test_a_model_made_again_under_its_name_leaves_no_unused_blobs(files, tmp_path):
    base, lora, _ = files
    write_lora(tmp_path / "other.gguf", base, ("blk.1.ffn_down.weight",), seed=9)
    a, b = import_file(lora, kind="adapter"), import_file(tmp_path / "other.gguf", kind="adapter")
    first = save_derived("tuned", "tiny-a", Profile(), (f"sha256:{a}",))
    second = save_derived("tuned", "tiny-a", Profile(), (f"sha256:{b}",))
    assert first.base != second.base
    assert _blobs() == sorted(f"sha256-{d.removeprefix('sha256:')}" for d in (second.base, f"sha256:{b}"))
    save_derived("tuned", "tiny-a", Profile(system="plain again"))
    assert _blobs() == [] and resolve_named("tuned").path == base


def test_an_update_that_is_not_finite_is_refused_mid_write_and_leaves_nothing(files, tmp_path):
    base, _, _ = files
    a = np.ones((2, 64), np.float32)
    b = np.full((64, 2), np.float32(3e38))  # finite in the file; B @ A overflows to inf
    pairs = {"blk.1.ffn_down.weight.lora_a": np.ones((2, 128), np.float32),  # another pair, a finite one
             "blk.1.ffn_down.weight.lora_b": np.ones((64, 2), np.float32),
             "blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    write_lora(tmp_path / "huge.gguf", base, targets=(), extra=pairs)
    adapter = import_file(tmp_path / "huge.gguf", kind="adapter")
    with pytest.raises(StoreError, match="blk.0.attn_q.weight: the adapter's update is not finite"):
        save_derived("x", "tiny-a", Profile(), (f"sha256:{adapter}",))
    assert find_derived("x") is None and _blobs() == [f"sha256-{adapter}"]
    assert not any(p.name.startswith(".upload-") for p in blobs_dir().iterdir())
