"""The CUDA side of the kernels: Triton kernels for paged attention (decode, prefill), the KV write and
grammar token masks, each with a PyTorch reference of the same signature (`*_reference`). The ops
below run the kernel on CUDA tensors and the reference on anything else, so the GPU model runner's
code runs on CPU tensors in CI. Importing this package never needs triton (see dispatch)."""
from tokenmill.kernels.gpu.dispatch import force, triton_available, use_triton
from tokenmill.kernels.gpu.ops import apply_token_bitmask, kv_write, paged_decode_attention, paged_prefill_attention
from tokenmill.kernels.gpu.references import (apply_token_bitmask_reference, kv_write_reference,
                                              paged_decode_attention_reference, paged_prefill_attention_reference)

__all__ = ["apply_token_bitmask", "apply_token_bitmask_reference", "force", "kv_write", "kv_write_reference",
           "paged_decode_attention", "paged_decode_attention_reference", "paged_prefill_attention",
           "paged_prefill_attention_reference", "triton_available", "use_triton"]
