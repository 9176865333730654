"""Decode steps in one kernel call: every decoder layer of a decode-only batch in C++.

At decode a small model's step is short (~36 ms for SmolLM2-135M at 16 sequences), and about a
quarter of it went to Python between the kernels: module dispatch, views, splits and cache
stores, ~300 us per layer. A :class:`FusedDecode` hands a decode-only batch to one of the CPU
kernels' layer stacks, which run the layers' kernels and torch ops in the order the Python
modules run them, so the results are the same bit for bit:

* :class:`LlamaFusedDecode` -> ``llama_decode_layers`` (``ops/cpu/decoder_layers.cpp``):
  Llama / Qwen2 layers (grouped-query attention, SwiGLU MLP), bf16 or fp32.

There is no DeepSeek stack: the one it had ran only on AMX machines (never on CI's AVX2 CPUs)
and carried a second hand-written copy of the DeepSeek layer and of the router, so DeepSeek
decodes run their layers' forwards and route through ``layers/moe/router.py`` alone.

Prompts, mixed and padded batches, and models or set-ups a stack does not cover (other layer
types, other dtypes, expert parallelism, EPLB, the step-time breakdown) take the layers' own
forwards: the reference twin (``WIDELLM_CPU_FUSED_DECODE=0`` forces it).
"""

from __future__ import annotations

import abc
import os

import torch
from torch import nn

from widellm.forward_context import ForwardContext
from widellm.layers.activation import SiluAndMul
from widellm.layers.attention import Attention
from widellm.layers.linear import Linear
from widellm.layers.linear_onednn import OneDNNPackedLinearMethod
from widellm.model.llama import DecoderLayer, DecoderModel, LlamaAttention, LlamaMLP
from widellm.ops.cpu_kernels import load_cpu_kernels

FUSED_DECODE_ENV = "WIDELLM_CPU_FUSED_DECODE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def fused_decode_enabled() -> bool:
    """``$WIDELLM_CPU_FUSED_DECODE`` (default on); raises ValueError on anything but a boolean."""
    value = os.environ.get(FUSED_DECODE_ENV, "1").strip().lower()
    if value in _TRUE + _FALSE:
        return value in _TRUE
    raise ValueError(f"{FUSED_DECODE_ENV}={value!r}: expected one of {_TRUE + _FALSE}")


def _packed(*linears: nn.Module | None) -> bool:
    return all(m is None or (isinstance(m, Linear)
                             and isinstance(m.linear_method, OneDNNPackedLinearMethod))
               for m in linears)


def _norms_in(dtypes: tuple[torch.dtype, ...], *norms: nn.Module) -> bool:
    """RMSNorms of one dtype among ``dtypes``, sharing one epsilon."""
    return (len({n.weight.dtype for n in norms}) == 1 and norms[0].weight.dtype in dtypes
            and len({n.variance_epsilon for n in norms}) == 1)


def _swiglu(mlp: nn.Module) -> bool:
    return (type(mlp) is LlamaMLP and type(mlp.act_fn) is SiluAndMul
            and _packed(mlp.gate_up_proj, mlp.down_proj)
            and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None)


class FusedDecode(abc.ABC):
    """Lifecycle: :meth:`build` once after the weights are loaded and packed (None when the
    layers are not covered); per forward, :meth:`applies` to the batch, then the call. The KV
    caches are read from the attention layers at each call (the model runner binds them after
    loading)."""

    # The activation dtypes a stack runs in; its layers' norms are in one of them.
    DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)

    @classmethod
    @abc.abstractmethod
    def build(cls, layers: nn.ModuleList, kernels) -> FusedDecode | None:
        """The stack for these layers, or None when it does not cover them."""

    @abc.abstractmethod
    def __call__(self, ctx: ForwardContext, positions: torch.Tensor,
                 x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], x [T, H] (the embeddings) -> (last layer's output, residual
        stream), as the layers' forwards return them."""

    def applies(self, ctx: ForwardContext, x: torch.Tensor) -> bool:
        """A batch of decodes only in one of :attr:`DTYPES`, read in place (block-table form),
        without padding."""
        md = ctx.attn_metadata
        return (md.num_decodes == md.num_tokens and md.decode_block_table is not None
                and md.padding_mask is None and x.dtype in self.DTYPES)


class LlamaFusedDecode(FusedDecode):
    # fp32 too: the stack's kernels (packed linears, norms, rotary, paged attention) are the
    # ones the layers call in fp32, so it is bit-equal to them there as well.
    DTYPES = (torch.bfloat16, torch.float32)

    def __init__(self, layers: list[DecoderLayer], kernels) -> None:
        self._kernels = kernels
        attn0 = layers[0].self_attn
        self._attn = [layer.self_attn.attn for layer in layers]
        self._rotary = attn0.rotary_emb
        self._shape = (attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, attn0.attn.scale,
                       layers[0].input_layernorm.variance_epsilon)
        mlps = [getattr(layer, layer.mlp_name) for layer in layers]
        self._weights = (
            [layer.input_layernorm.weight for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            [layer.self_attn.qkv_proj.packed_weight for layer in layers],
            [layer.self_attn.qkv_proj.bias for layer in layers],
            [layer.self_attn.o_proj.packed_weight for layer in layers],
            [layer.self_attn.o_proj.bias for layer in layers],
            [mlp.gate_up_proj.packed_weight for mlp in mlps],
            [mlp.down_proj.packed_weight for mlp in mlps],
        )

    @staticmethod
    def _covers(layer: nn.Module) -> bool:
        if type(layer) is not DecoderLayer:
            return False
        attn = layer.self_attn
        return (type(attn) is LlamaAttention and attn.q_norm is None
                and type(attn.attn) is Attention and _packed(attn.qkv_proj, attn.o_proj)
                and _swiglu(getattr(layer, layer.mlp_name))
                and _norms_in(LlamaFusedDecode.DTYPES, layer.input_layernorm,
                              layer.post_attention_layernorm)
                and attn.rotary_emb.rotary_dim == attn.head_dim)

    @classmethod
    def build(cls, layers: nn.ModuleList, kernels) -> LlamaFusedDecode | None:
        if not all(cls._covers(layer) for layer in layers):
            return None

        def shape(layer: DecoderLayer) -> tuple:
            a = layer.self_attn
            return (a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale, a.rotary_emb,
                    layer.input_layernorm.variance_epsilon)

        if len({shape(layer) for layer in layers}) != 1:
            return None
        return cls(list(layers), kernels)

    def __call__(self, ctx, positions, x):
        md = ctx.attn_metadata
        num_heads, num_kv_heads, head_dim, scale, eps = self._shape
        return tuple(self._kernels.llama_decode_layers(
            x, positions, md.slot_mapping, md.decode_block_table, md.decode_seq_lens,
            *self._weights, [a.kv_cache for a in self._attn], self._rotary.cos_cache,
            self._rotary.sin_cache, self._rotary.style == "interleaved", num_heads,
            num_kv_heads, head_dim, scale, eps,
        ))


FUSED_DECODE_STACKS: tuple[type[FusedDecode], ...] = (LlamaFusedDecode,)


def enable_fused_decode(model: nn.Module) -> bool:
    """Give ``model``'s decoder (``model.model``, a :class:`DecoderModel`) the first stack of
    :data:`FUSED_DECODE_STACKS` that covers its layers; True if one did."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel) or not len(decoder.layers):
        return False
    kernels = load_cpu_kernels() if fused_decode_enabled() else None
    if kernels is None:
        return False
    for stack in FUSED_DECODE_STACKS:
        decoder.fused_decode = stack.build(decoder.layers, kernels)
        if decoder.fused_decode is not None:
            return True
    return False
