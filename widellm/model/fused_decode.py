"""Decode steps in one kernel call: every decoder layer of a decode-only batch in C++.

At decode a small model's step is short (~36 ms for SmolLM2-135M at 16 sequences), and about a
quarter of it went to Python between the kernels: module dispatch, views, splits and cache
stores, ~300 us per layer. A :class:`FusedDecode` hands a decode-only batch to one of the CPU
kernels' layer stacks, which run the layers' kernels and torch ops in the order the Python
modules run them, so the results are the same bit for bit:

* :class:`LlamaFusedDecode` -> ``llama_decode_layers`` (``ops/cpu/decoder_layers.cpp``):
  Llama / Qwen2 layers (grouped-query attention, SwiGLU MLP), bf16 or fp32;
* :class:`DeepseekFusedDecode` -> ``deepseek_decode_layers``
  (``ops/cpu/deepseek_decode_layers.cpp``): DeepSeek-V2/V3 layers (MLA through the AMX MLA
  kernel; dense MLP or MoE with local experts through ``fused_experts``), bf16.

Prompts, mixed and padded batches, and models or set-ups a stack does not cover (other layer
types, other dtypes, expert parallelism, EPLB, the step-time breakdown) take the layers' own
forwards:
the reference twin (``WIDELLM_CPU_FUSED_DECODE=0`` forces it).
"""

from __future__ import annotations

import abc
import os

import torch
from torch import nn

from widellm.forward_context import ForwardContext
from widellm.layers.activation import SiluAndMul
from widellm.layers.attention import Attention
from widellm.layers.linear import PackedLinear
from widellm.layers.moe.dispatch import LocalDispatcher
from widellm.layers.moe.experts import DOT_KERNEL_MAX_ROWS_PER_EXPERT
from widellm.layers.moe.router import RENORM_EPS
from widellm.model.deepseek import DeepseekMLAAttention, DeepseekMoE
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
    return all(m is None or type(m) is PackedLinear for m in linears)


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


def _linear_slots(name: str, linear: nn.Module | None) -> dict[str, torch.Tensor | None]:
    if linear is None:
        return {name: None, name + "_bias": None}
    return {name: linear.packed_weight, name + "_bias": linear.bias}


class DeepseekFusedDecode(FusedDecode):
    # One layer's weights in the order of deepseek_decode_layers.cpp's Slot enum.
    SLOTS = ("input_norm", "post_norm", "q_proj", "q_proj_bias", "q_a", "q_a_bias", "q_a_norm",
             "q_b", "q_b_bias", "kv_a", "kv_a_bias", "kv_a_norm", "w_uk", "w_uv_t", "o",
             "o_bias", "gate_up", "down", "router", "router_bias", "w13", "w2")

    def __init__(self, layers: list[DecoderLayer], kernels) -> None:
        self._kernels = kernels
        attn0 = layers[0].self_attn
        self._mla = [layer.self_attn.mla for layer in layers]
        self._rotary = attn0.rotary_emb
        self._layers = [self._slots(layer) for layer in layers]
        mla = attn0.mla
        self._shape = (mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
                       mla.kv_lora_rank, mla.scale, layers[0].input_layernorm.variance_epsilon)
        moes = [m.experts for m in (getattr(x, x.mlp_name) for x in layers)
                if type(m) is DeepseekMoE]
        self._routing = self._max_rows = None
        if moes:
            r, e = moes[0].routing, moes[0]
            self._routing = (e.top_k, r.scoring_func == "sigmoid", r.renormalize,
                             r.num_expert_group or 0, r.topk_group or 0,
                             r.group_score == "top2_sum", r.routed_scaling_factor, RENORM_EPS)
            # fused_experts' dot-product path runs decode-sized batches only (experts.py).
            backend = kernels.fused_experts_backend(e.hidden_size, e.intermediate_size)
            self._max_rows = (None if backend == "amx"
                              else DOT_KERNEL_MAX_ROWS_PER_EXPERT * e.num_local_experts)

    @staticmethod
    def _slots(layer: DecoderLayer) -> list[torch.Tensor | None]:
        attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
        q_lora = attn.q_lora_rank is not None
        slots = {
            "input_norm": layer.input_layernorm.weight,
            "post_norm": layer.post_attention_layernorm.weight,
            **_linear_slots("q_proj", None if q_lora else attn.q_proj),
            **_linear_slots("q_a", attn.q_a_proj if q_lora else None),
            "q_a_norm": attn.q_a_layernorm.weight if q_lora else None,
            **_linear_slots("q_b", attn.q_b_proj if q_lora else None),
            **_linear_slots("kv_a", attn.kv_a_proj_with_mqa),
            "kv_a_norm": attn.kv_a_layernorm.weight,
            "w_uk": attn.mla.w_uk, "w_uv_t": attn.mla.w_uv_t,
            **_linear_slots("o", attn.o_proj),
        }
        dense = mlp if type(mlp) is LlamaMLP else mlp.shared_experts
        slots["gate_up"] = dense.gate_up_proj.packed_weight if dense is not None else None
        slots["down"] = dense.down_proj.packed_weight if dense is not None else None
        moe = type(mlp) is DeepseekMoE
        slots["router"] = mlp.gate.weight if moe else None
        slots["router_bias"] = mlp.gate.e_score_correction_bias if moe else None
        slots["w13"] = mlp.experts.w13_weight if moe else None
        slots["w2"] = mlp.experts.w2_weight if moe else None
        return [slots[name] for name in DeepseekFusedDecode.SLOTS]

    @staticmethod
    def _covers(layer: nn.Module) -> bool:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not DeepseekMLAAttention:
            return False
        attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
        q_lora = attn.q_lora_rank is not None
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.kv_a_layernorm]
        norms += [attn.q_a_layernorm] if q_lora else []
        attention_ok = (
            _packed(*((attn.q_a_proj, attn.q_b_proj) if q_lora else (attn.q_proj,)),
                    attn.kv_a_proj_with_mqa, attn.o_proj)
            and _norms_in(DeepseekFusedDecode.DTYPES, *norms) and attn.mla.w_uk is not None
            and attn.mla.w_uk.dtype == torch.bfloat16
            and attn.rotary_emb.rotary_dim == attn.qk_rope_head_dim)
        if type(mlp) is LlamaMLP:
            return attention_ok and _swiglu(mlp)
        if type(mlp) is not DeepseekMoE:
            return False
        experts = mlp.experts
        # No EPLB placement (which also records the expert load) and every expert local.
        local = (type(experts.dispatcher) is LocalDispatcher and experts.placement is None
                 and torch.equal(experts.dispatcher.expert_map,
                                 torch.arange(experts.num_experts)))
        return (attention_ok and local and experts.w13_weight.dtype == torch.bfloat16
                and (mlp.shared_experts is None or _swiglu(mlp.shared_experts)))

    @classmethod
    def build(cls, layers: nn.ModuleList, kernels) -> DeepseekFusedDecode | None:
        if not all(cls._covers(layer) for layer in layers):
            return None
        if len({layer.input_layernorm.variance_epsilon for layer in layers}) != 1:
            return None
        moe_layers = [x for x in layers if type(getattr(x, x.mlp_name)) is DeepseekMoE]
        if moe_layers:
            e0 = getattr(moe_layers[0], moe_layers[0].mlp_name).experts
            if kernels.fused_experts_backend(e0.hidden_size, e0.intermediate_size) == "none":
                return None
        return cls(list(layers), kernels)

    def applies(self, ctx, x):
        # The MoE layers time their phases when the step breakdown is collected.
        rows = x.shape[0] * (self._routing[0] if self._routing else 0)
        return (super().applies(ctx, x) and ctx.step_timer is None
                and (self._max_rows is None or rows <= self._max_rows))

    def __call__(self, ctx, positions, x):
        md = ctx.attn_metadata
        routing = self._routing or (0, False, False, 0, 0, False, 1.0, RENORM_EPS)
        return tuple(self._kernels.deepseek_decode_layers(
            x, positions, md.slot_mapping, md.decode_block_table, md.decode_seq_lens,
            self._layers, [m.kv_cache for m in self._mla], self._rotary.cos_cache,
            self._rotary.sin_cache, self._rotary.style == "interleaved", *self._shape,
            *routing,
        ))


FUSED_DECODE_STACKS: tuple[type[FusedDecode], ...] = (LlamaFusedDecode, DeepseekFusedDecode)


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
