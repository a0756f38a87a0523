"""The CUDA side of the kernels: Triton kernels for paged attention (decode, prefill), the KV write,
grammar token masks and a decoder layer's small ops (RMSNorm with the residual step, rotary
embedding with Gemma 3's head norm, gated activations), each with a PyTorch reference of the same signature (`*_reference`). The ops
below run the kernel on CUDA tensors and the reference on anything else, so the GPU model runner's
code runs on CPU tensors in CI. Importing this package never needs triton (see dispatch)."""
from tokenmill.kernels.gpu.dispatch import force, triton_available, use_triton
from tokenmill.kernels.gpu.ops import (apply_token_bitmask, gated_activation, kv_write, paged_decode_attention,
                                       paged_prefill_attention, residual_rms_norm, rms_norm, rope,
                                       rope_kv_write)
from tokenmill.kernels.gpu.references import (apply_token_bitmask_reference, gated_reference, kv_write_reference,
                                              paged_decode_attention_reference, paged_prefill_attention_reference,
                                              residual_norm_reference, rope_reference)

__all__ = ["apply_token_bitmask", "apply_token_bitmask_reference", "force", "gated_activation", "gated_reference",
           "kv_write", "kv_write_reference", "paged_decode_attention", "paged_decode_attention_reference",
           "paged_prefill_attention", "paged_prefill_attention_reference", "residual_norm_reference",
           "residual_rms_norm", "rms_norm", "rope", "rope_kv_write", "rope_reference", "triton_available",
           "use_triton"]
