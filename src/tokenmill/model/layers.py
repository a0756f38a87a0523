"""Building blocks shared by every architecture: norms, rotary embeddings, attention over the paged
cache, gated MLPs. Projections that read the same input are fused (QKV, gate+up) so a step issues
fewer, larger matmuls."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.gguf.config import LONGROPE, ModelConfig
from tokenmill.gguf.reader import GGUFError
from tokenmill.kernels import fused, native
from tokenmill.kernels import gpu as gpu_ops
from tokenmill.kvcache.storage import LayerKV
from tokenmill.model.attention import (AttentionMetadata, GraphDecodeMeta, GraphStepMeta, fused_decode_attention,
                                       paged_attention_op, write_and_attend)
from tokenmill.model.gpu.batch import DeviceBatch, attend_device, write_and_attend_device
from tokenmill.model.linear import Linear
from tokenmill.model.paged_batch import PagedBatch, write_and_attend_native


def use_fused(x: torch.Tensor) -> bool:
    """The native fused ops take float32 activations (the gguf weight mode, and fp32)."""
    return x.dtype == torch.float32 and native.module() is not None


def _param(*shape: int) -> nn.Parameter:
    # Weights always come from the GGUF, so random initialisation would be wasted work.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    """Llama's RMSNorm rounds the normalised activations to the model dtype before the weight
    multiplies them; Gemma's (`weight_in_float32`) multiplies first, in float32. (Gemma checkpoints
    store weight-1; GGUF converters have already added the 1 back.)"""

    def __init__(self, dim: int, eps: float, *, weight_in_float32: bool = False):
        super().__init__()
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.weight = _param(dim)

    @property
    def spec(self) -> tuple[torch.Tensor, float, bool]:
        """(weight, eps, weight_in_float32): this norm as the GPU kernels take it."""
        return self.weight, self.eps, self.weight_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):  # in float32 both flavours are the same product
            return fused.rms_norm(x, self.weight, self.eps)
        if gpu_ops.use_triton(x):  # one kernel, not seven
            return gpu_ops.rms_norm(x, *self.spec)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            return (x32 * self.weight.float()).to(dtype)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the half-split (NEOX) layout: dimension i pairs with i + d/2.
    Llama GGUFs store Q/K rows interleaved (llama.cpp's NORM mode); their loader permutes those rows
    once, so every architecture rotates the same way, q and k together, in three kernels."""

    def __init__(self, rope_dim: int, theta: float, max_positions: int, *, linear_scaling: float = 1.0):
        super().__init__()
        self.theta = theta
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)) / linear_scaling
        self._file_inv_freq = self.inv_freq  # before any per-frequency factors (set_longrope starts from it)
        self.magnitude = 1.0  # cos and sin scaled by it (LongRoPE's attention factor: set_longrope)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._build(max_positions)

    def _build(self, max_positions: int) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), self.inv_freq)
        # Rounded to float32 before the halves are joined (the same values): the float64 copies of
        # the whole tables would cost twice what the tables do.
        cos, sin = (freqs.cos() * self.magnitude).float(), (freqs.sin() * self.magnitude).float()
        del freqs
        device = self.cos.device  # tables rebuilt after the model moved (to a GPU) stay where it is
        self.cos = torch.cat([cos, cos], -1).to(device)
        # rotate_half(x) = cat(-x2, x1); the sign lives in the table so a swap of halves suffices.
        self.sin = torch.cat([-sin, sin], -1).to(device)

    @classmethod
    def unrotated(cls, rope_dim: int, max_positions: int) -> "RotaryEmbedding":
        """Tables that rotate by nothing (cos 1, sin 0: x * 1 + y * 0 is x), for a model's layers
        without positions (SmolLM3's NoPE layers), so that every layer runs the same kernels."""
        rope = cls(rope_dim, 10000.0, 1)
        rope.inv_freq = torch.zeros_like(rope.inv_freq)
        rope._build(max_positions)
        return rope

    def divide_frequencies(self, factors: torch.Tensor) -> None:
        """Each frequency divided by its factor (llama.cpp's rope_freqs: Llama 3.1+'s "llama3" scaling,
        which transformers computes from rope_parameters: the same frequencies), the tables rebuilt."""
        if factors.shape != self.inv_freq.shape or not bool(torch.isfinite(factors).all() and (factors > 0).all()):
            raise ValueError(f"rope_freqs must be {self.inv_freq.numel()} positive factors")
        self.inv_freq = self.inv_freq / factors.to(torch.float64)
        self._build(self.cos.shape[0])

    def set_yarn(self, factor: float, original_positions: int, beta_fast: float, beta_slow: float,
                 magnitude: float) -> None:
        """YaRN (rope.scaling.type yarn: Qwen's long-context settings): each frequency between its own
        (extrapolated) and the factor's interpolation, by a linear ramp over the dimensions between
        beta_fast and beta_slow rotations in the original context (floored and ceiled, as llama.cpp's
        corr_dims and transformers' truncate), and cos/sin scaled by magnitude * (1 + 0.1 ln factor)."""
        n = self.inv_freq.numel()
        dim, base_freq = 2 * n, self.inv_freq

        def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times in the original context
            return dim * math.log(original_positions / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(n, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
        self.inv_freq = base_freq / factor * ramp + base_freq * (1 - ramp)
        self.magnitude = float(magnitude) * (1 + 0.1 * math.log(factor) if factor > 1 else 1.0)
        self._build(self.cos.shape[0])

    def set_longrope(self, factors: torch.Tensor, magnitude: float) -> None:
        """LongRoPE (Phi-3's 128k models, Phi-3.5, Phi-4-mini): each frequency divided by its factor, as
        divide_frequencies, and the tables scaled by the attention factor (transformers' and llama.cpp's
        attn_factor: every q.k then carries its square). Again with the other factors, it replaces the first."""
        self.magnitude = float(magnitude)
        self.inv_freq = self._file_inv_freq
        self.divide_frequencies(factors)

    def at(self, positions: torch.Tensor, dtype: torch.dtype, *, check: bool = True, fused: bool = False) -> "Rope":
        """The rotation for these positions: gathered cos/sin rows, or (fused) the positions and the
        whole tables, which the native kernel indexes itself."""
        if check and positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} beyond the rotary table ({self.cos.shape[0]})")
        if fused:
            return Rope(positions, self.cos, self.sin, fused=True)
        return Rope(positions, self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos/sin: [T, 1, rope_dim], rotating the first rope_dim dims (all of
        them but in Phi-4-mini's partial rotation)."""
        rope_dim = cos.shape[-1]
        if rope_dim < x.shape[-1]:
            return torch.cat([RotaryEmbedding.apply(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)


def file_rotary(cfg: ModelConfig) -> RotaryEmbedding:
    """The rotary embedding of the file's base and scaling (rope.scaling.type): none; linear (positions
    divided by the factor: long-context fine-tunes, Gemma 3's larger models); yarn (Qwen's long-context
    settings: RotaryEmbedding.set_yarn, with rope.scaling.original_context_length, the yarn_beta_*
    keys and attn_factor as llama.cpp reads them). longrope is a phi3 file's (its factor tensors:
    model/phi3.py); anything else is refused rather than ignored. Llama 3.1's own scaling comes as a
    tensor (rope_freqs: RotaryEmbedding.divide_frequencies), not a type."""
    kind = cfg.extra.get("rope.scaling.type")
    factor = float(cfg.extra.get("rope.scaling.factor", 1.0))
    if kind in ("longrope", "su") and cfg.extra.get(LONGROPE):  # the model applies the file's factors
        kind = None
    if kind not in (None, "none", "linear", "yarn"):
        raise GGUFError(f"{cfg.name}: rope scaling {kind!r} is not supported for {cfg.architecture} "
                        "(linear and yarn are)")
    rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.context_length,
                           linear_scaling=factor if kind == "linear" else 1.0)
    if kind == "yarn":  # ModelConfig.checked has checked its numbers and that the original context is there
        def number(key: str, default: float) -> float:
            return float(cfg.extra.get(f"rope.scaling.{key}", default))

        # Variants of YaRN (gpt-oss's, DeepSeek's) that tokenmill does not run: refused, not run as plain YaRN.
        for key, plain in (("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            if number(key, plain) != plain:
                raise GGUFError(f"{cfg.name}: YaRN with rope.scaling.{key} other than {plain:g} is not supported")
        rope.set_yarn(factor, cfg.extra["rope.scaling.original_context_length"], number("yarn_beta_fast", 32.0),
                      number("yarn_beta_slow", 1.0), number("attn_factor", 1.0))
    return rope


def residual_step(x: torch.Tensor, a: torch.Tensor, pre: "RMSNorm | None",
                  post: "RMSNorm | None") -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's residual step: x + pre(a) (x + a without pre), and post() of that sum (None without
    post). On the GPU one kernel that updates x in place (x is the block's own activation, read by
    nothing else); elsewhere the plain ops."""
    if gpu_ops.use_triton(x):
        h = gpu_ops.residual_rms_norm(a, x, None if pre is None else pre.spec, None if post is None else post.spec)
        return x, h
    s = x + (a if pre is None else pre(a))
    return s, None if post is None else post(s)


@dataclass
class Rope:
    """Rotary inputs of one step: cos/sin [T, 1, rope_dim] gathered, or with `fused` the tables
    [max_positions, rope_dim] plus the positions."""
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool = False


def interleaved_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q/K projection rows from pairwise-interleaved rotary layout to half-split."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class Attention(nn.Module):
    """Grouped-query attention over the paged cache. Options: `qk_norm_eps` adds RMSNorms over each q
    and k head before the rotary embedding (Gemma 3's, or with `qk_norm_weight_in_float32` False
    Qwen3's, which rounds before the weight as Llama's norm does); `window` makes it a sliding-window
    layer (Gemma 2 and 3); `softcap` soft-caps the scores, cap * tanh(s / cap) (Gemma 2)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 qk_norm_eps: float | None = None, qk_norm_weight_in_float32: bool = True,
                 window: int | None = None, softcap: float = 0.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.qkv_proj = Linear((n_heads + 2 * n_kv_heads) * head_dim, dim)
        self.o_proj = Linear(dim, n_heads * head_dim)
        norms = qk_norm_eps is not None
        in_float32 = qk_norm_weight_in_float32
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, weight_in_float32=in_float32) if norms else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, weight_in_float32=in_float32) if norms else None

    @property
    def score_scale(self) -> float:
        """What q.k is scaled by: 1/sqrt(head_dim) unless the model sets its own."""
        return self.head_dim ** -0.5 if self.scale is None else self.scale

    def forward(self, x: torch.Tensor, rope: Rope,
                meta: AttentionMetadata | GraphDecodeMeta | GraphStepMeta | PagedBatch | DeviceBatch,
                cache: LayerKV) -> torch.Tensor:
        """The block's attention on its normed input x: projections, rotary embedding, this step's K/V
        into the cache, attention over it, output projection. On the GPU the rotation and the K/V
        write are one kernel (kernels.gpu.rope_kv_write); elsewhere project_qkv, then attend."""
        if rope.fused and isinstance(meta, DeviceBatch) and gpu_ops.use_triton(x):
            heads = self.n_heads + 2 * self.n_kv_heads
            qkv = self.qkv_proj(x).view(-1, heads, self.head_dim)
            head_norm = None if self.q_norm is None else (self.n_heads, self.q_norm.weight, self.k_norm.weight,
                                                           self.q_norm.eps)
            gpu_ops.rope_kv_write(qkv, self.n_heads, rope.positions, rope.cos, rope.sin, head_norm, cache.k, cache.v,
                                  meta.slot_mapping)
            out = attend_device(qkv[:, :self.n_heads], cache, meta, self.score_scale, self.window or 0, self.softcap)
            return self.o_proj(out.flatten(1))
        q, k, v = self.project_qkv(x, rope)
        return self.attend(q, k, v, meta, cache)

    def project_qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused QKV projection with rotary embedding applied to q and k in one go."""
        qkv = self.qkv_proj(x)
        hd = self.head_dim
        if rope.fused:  # in place on the projection's output: no copies until attention
            qkv3 = qkv.view(-1, self.n_heads + 2 * self.n_kv_heads, hd)
            qk = qkv3[:, :self.n_heads + self.n_kv_heads]
            if self.q_norm is not None:
                fused.head_rms_norm_rope(qk, self.n_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                         rope.positions, rope.cos, rope.sin)
            else:
                fused.rope_qk(qk, rope.positions, rope.cos, rope.sin)
            return qk[:, :self.n_heads], qk[:, self.n_heads:], qkv3[:, self.n_heads + self.n_kv_heads:]
        qk, v = qkv.split([(self.n_heads + self.n_kv_heads) * hd, self.n_kv_heads * hd], dim=-1)
        qk = qk.view(-1, self.n_heads + self.n_kv_heads, hd)
        cos, sin = rope.cos, rope.sin
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.n_heads]), self.k_norm(qk[:, self.n_heads:])], dim=1)
        qk = RotaryEmbedding.apply(qk, cos, sin)
        return qk[:, :self.n_heads], qk[:, self.n_heads:], v.view(-1, self.n_kv_heads, hd)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata | GraphDecodeMeta | GraphStepMeta | PagedBatch | DeviceBatch,
               cache: LayerKV) -> torch.Tensor:
        k_cache, v_cache = cache.k, cache.v
        scale = self.score_scale
        if isinstance(meta, PagedBatch):
            out = write_and_attend_native(q, k, v, cache, meta, scale, self.window or 0, self.softcap)
        elif isinstance(meta, GraphStepMeta):
            out = paged_attention_op(q, k, v, k_cache, v_cache, meta.key, scale, self.window or 0, self.softcap)
        elif isinstance(meta, GraphDecodeMeta):
            # index_put_ rather than index_copy_: inductor lowers it to an in-place scatter.
            k_cache[:, meta.slot_mapping] = k.transpose(0, 1)
            v_cache[:, meta.slot_mapping] = v.transpose(0, 1)
            if self.window:
                meta = meta.with_window(self.window)
            out = fused_decode_attention(q, k_cache, v_cache, meta, self.scale, self.softcap)
        elif isinstance(meta, DeviceBatch):  # the GPU path (model/gpu/batch.py)
            out = write_and_attend_device(q, k, v, cache, meta, scale, self.window or 0, self.softcap)
        else:
            out = write_and_attend(q, k, v, k_cache, v_cache, meta.with_window(self.window) if self.window else meta,
                                   self.scale, self.softcap)
        return self.o_proj(out.flatten(1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); SwiGLU for Llama, GeGLU (tanh GELU) for Gemma."""

    def __init__(self, dim: int, hidden: int, *, activation: str = "silu"):
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = Linear(2 * hidden, dim)
        self.down_proj = Linear(dim, hidden)
        self.activation = activation
        self.act = F.silu if activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_fused(gate_up):
            act = fused.silu_mul if self.activation == "silu" else fused.gelu_tanh_mul
            return self.down_proj(act(gate_up))
        if gpu_ops.use_triton(gate_up):
            return self.down_proj(gpu_ops.gated_activation(gate_up, self.activation))
        gate, up = gate_up.split(self.hidden, dim=-1)
        return self.down_proj(self.act(gate) * up)
