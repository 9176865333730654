"""Decode steps of Llama-family models in one kernel call.

At decode a small model's step is short (~36 ms for SmolLM2-135M at 16 sequences), and about a
fifth of it went to Python between the kernels: module dispatch, views, splits and two cache
stores per layer, ~240 us per layer. :class:`FusedDecode` hands a decode-only batch to the CPU
kernels' ``llama_decode_layers`` (``widellm/ops/cpu/decoder_layers.cpp``), which runs every
layer's kernels (packed linears, fused norms, rotary, paged decode attention) in the order the
Python layers run them, so the results are the same bit for bit. Prompts, mixed batches and
models it does not cover take the layers' own ``forward``: the reference twin
(``WIDELLM_CPU_FUSED_DECODE=0`` forces it).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from widellm.layers.activation import SiluAndMul
from widellm.layers.attention import Attention
from widellm.layers.attention_metadata import AttentionMetadata
from widellm.layers.linear import PackedLinear
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


def _is_plain_llama_layer(layer: nn.Module) -> bool:
    """A DecoderLayer of grouped-query attention (no q/k norm) and a SwiGLU MLP, every linear
    packed for oneDNN in bf16, the norms in bf16."""
    if type(layer) is not DecoderLayer:
        return False
    attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
    if type(attn) is not LlamaAttention or attn.q_norm is not None or type(attn.attn) is not Attention:
        return False
    if type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul:
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (all(type(m) is PackedLinear for m in linears)
            and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None
            and all(n.weight.dtype == torch.bfloat16 for n in norms)
            and norms[0].variance_epsilon == norms[1].variance_epsilon
            and attn.rotary_emb.rotary_dim == attn.head_dim)


class FusedDecode:
    """The layers of one model, gathered for ``llama_decode_layers``. Built by :meth:`build`
    after the weights are loaded and packed; the KV caches are read from the attention layers
    at each call (the model runner binds them later)."""

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

    @classmethod
    def build(cls, layers: nn.ModuleList) -> FusedDecode | None:
        """The fused path for these layers, or None when it does not cover them (another
        layer type, unpacked or non-bf16 weights, per-layer shapes that differ, no kernels)."""
        if not len(layers) or not fused_decode_enabled():
            return None
        kernels = load_cpu_kernels()
        if kernels is None or not all(_is_plain_llama_layer(layer) for layer in layers):
            return None
        first = layers[0]

        def shape(layer: DecoderLayer) -> tuple:
            a = layer.self_attn
            return (a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale, a.rotary_emb,
                    layer.input_layernorm.variance_epsilon)

        if any(shape(layer) != shape(first) for layer in layers):
            return None
        return cls(list(layers), kernels)

    def applies(self, md: AttentionMetadata, x: torch.Tensor) -> bool:
        """A bf16 batch of decodes only, read in place (block-table form), without padding."""
        return (md.num_decodes == md.num_tokens and md.decode_block_table is not None
                and md.padding_mask is None and x.dtype == torch.bfloat16)

    def __call__(
        self, md: AttentionMetadata, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], x [T, H] (the embeddings) -> (last layer's output, residual stream),
        as the layers' forwards return them."""
        num_heads, num_kv_heads, head_dim, scale, eps = self._shape
        return tuple(self._kernels.llama_decode_layers(
            x, None, positions, md.slot_mapping, md.decode_block_table, md.decode_seq_lens,
            *self._weights, [a.kv_cache for a in self._attn], self._rotary.cos_cache,
            self._rotary.sin_cache, self._rotary.style == "interleaved", num_heads,
            num_kv_heads, head_dim, scale, eps,
        ))


def enable_fused_decode(model: nn.Module) -> bool:
    """Give ``model``'s decoder (``model.model``, a :class:`DecoderModel`) the fused decode
    path where :meth:`FusedDecode.build` accepts its layers; True if it did."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel):
        return False
    decoder.fused_decode = FusedDecode.build(decoder.layers)
    return decoder.fused_decode is not None
