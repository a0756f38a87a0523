"""Builds every Triton kernel of tokenmill.kernels.gpu for an H100/H200 (sm_90) without a GPU: Triton's
compiler and ptxas run on the CPU, so a kernel that would not compile (types, shapes, tl.dot limits,
shared memory) fails here, in CI, rather than on the GPU machine. Must run in a process without
TRITON_INTERPRET (test_gpu_build.py starts it so). Prints one line per kernel with ptxas's register,
spill (STACK) and shared-memory figures.

    .venv/bin/python tests/kernels/gpu/gpu_sm90_build.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.gpu import activations, cache_write, decode_attention, norms, prefill_attention, rotary, token_mask
from tokenmill.kernels.gpu.ops import DECODE_PARTS

TARGET = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"scale_log2", "cap_log2", "pre_eps", "post_eps", "eps"}
# (head_dim, query heads per kv head, soft-capped scores): SmolLM2-135M, Gemma 3 270M, Gemma 2 2B.
MODELS = [(64, 3, False), (256, 4, False), (256, 2, True)]


def resource_usage(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(next((line.split()[:2] for line in text.splitlines() if "REG:" in line), ["?"]))


def build(kernel, pointers: dict[str, str], constants: dict, num_warps: int) -> None:
    signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name in FLOAT_ARGS else "i32")
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=TARGET, options={"num_warps": num_warps})
    shown = {k: v for k, v in constants.items() if k.startswith(("BLOCK", "GROUP", "CAP"))}
    print(f"{kernel.__name__} {shown} warps={num_warps}: {resource_usage(compiled.asm['cubin'])} "
          f"shared={compiled.metadata.shared}", flush=True)


def main() -> int:
    bf16 = "*bf16"
    for head_dim, group, cap in MODELS:
        block_d, block_n, warps = decode_attention.decode_tiles(head_dim)
        parts = DECODE_PARTS
        build(decode_attention._decode_part_kernel,
              dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, table_ptr="*i32", lens_ptr="*i32", part_out_ptr="*fp32",
                   part_lse_ptr="*fp32"),
              dict(PARTS=parts, GROUP=group, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION="tf32", CAP=cap),
              warps)
        build(decode_attention._decode_merge_kernel,
              dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", lens_ptr="*i32", out_ptr=bf16),
              dict(PARTS=parts, BLOCK_N=block_n, BLOCK_D=block_d), decode_attention.merge_warps(block_d))
        block_d, block_m, block_n, warps = prefill_attention.prefill_tiles(head_dim)
        build(prefill_attention._prefill_kernel,
              dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, out_ptr=bf16, table_ptr="*i32", cu_ptr="*i32",
                   lens_ptr="*i32"),
              dict(GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION="tf32", CAP=cap), warps)
        build(cache_write._kv_write_kernel,
              dict(k_ptr=bf16, v_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16, slot_ptr="*i64"),
              dict(BLOCK_D=block_d), 4)
    build(token_mask._token_bitmask_kernel, dict(logits_ptr="*fp32", mask_ptr="*i32"),
          dict(BLOCK=token_mask.BLOCK_V), 4)
    # the layer's small ops at SmolLM2's and Gemma 3's widths (576, 640: blocks of 1024)
    for flags in [dict(PRE=False, PRE_F32=False, RESIDUAL=False, POST=True, POST_F32=False),
                  dict(PRE=False, PRE_F32=False, RESIDUAL=True, POST=True, POST_F32=False),
                  dict(PRE=True, PRE_F32=True, RESIDUAL=True, POST=True, POST_F32=True),
                  dict(PRE=True, PRE_F32=True, RESIDUAL=True, POST=False, POST_F32=False)]:
        build(norms._residual_norm_kernel,
              dict(a_ptr=bf16, res_ptr=bf16, out_ptr=bf16, pre_w_ptr=bf16, post_w_ptr=bf16),
              dict(flags, BLOCK=1024), 4)
    for head_norm, block_d in [(False, 64), (True, 256)]:
        for write_kv in (False, True):  # the decode graphs' positions and slots are int32
            build(rotary._rope_kernel, dict(qk_ptr=bf16, pos_ptr="*i32", cos_ptr="*fp32", sin_ptr="*fp32",
                                            q_w_ptr=bf16, k_w_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16,
                                            slot_ptr="*i32"),
                  dict(HEAD_NORM=head_norm, WRITE_KV=write_kv, BLOCK_D=block_d), 1)
    for gelu in (False, True):
        build(activations._gated_kernel, dict(gu_ptr=bf16, out_ptr=bf16), dict(GELU=gelu, BLOCK=activations.BLOCK), 4)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter builds nothing")
    sys.exit(main())
