"""The simulator's analytic cost model: seconds per lockstep step of a pool, per rank, from each
rank's counts (``RankStepLoad``), the model's shape and the hardware profile.

Per operation (all per rank; sources of the constants in ``hardware.py``):

* GEMMs (attention projections, dense MLPs, shared experts, router, LM head): a roofline,
  ``max(2 M P / (peak(dtype) * eff(M)), P * bytes(dtype) / (bw * gemm_mem_eff))`` for M rows
  and P weights, with ``eff(M)`` DeepGEMM's measured efficiency curve (the CPU profile: the
  sum of the two terms, ``roofline_overlap`` 0, as widellm's CPU linear measures). Weights in
  ``fp8`` run at the FP8 peak; MLA's kv_b and the LM head stay BF16 (as in DeepSeek's FP8
  checkpoint).
* Routed experts: the same roofline over the rows this rank's experts receive
  (``expert_recv_tokens``), at the efficiency of the mean rows per active expert, reading each
  active expert's weights once (the CPU profile: widellm's expert kernel's measured curve over
  rows per expert instead). An unbalanced EPLB placement gives one rank more rows, and the
  lockstep rule below makes every rank pay for it.
* Attention: FLOPs of the (row, key) pairs at the attention efficiency vs the KV bytes read at
  its memory efficiency, whichever is longer. MLA decode is absorbed, prefill expanded (plus
  kv_b expanding the cached context of prompt chunks); see ``model_shape.py``.
* Dispatch / combine: ``links.all_to_all_time`` over the routed copies' bytes (FP8 rows out,
  BF16 rows back on GPUs), normal mode deduplicated per remote node; whole fixed-capacity
  blocks where the link moves them (``fixed_a2a_full_buffer``: gloo).
* Elementwise ops (norms, residual adds, activation functions, packing routed copies): the
  bytes of their activation passes (``NORM_RESIDUAL_PASSES`` ...) at the memory bandwidth.
* Launch: kernels per layer (``KERNELS_PER_LAYER``) times the per-kernel host cost; on GPUs the
  host launches asynchronously, so eager launch costs only what it exceeds the device time by,
  and CUDA graphs (decode steps, ``deployment.cuda_graphs``) cost a small gap per kernel; on
  CPU every op's overhead adds to the step.

Lockstep: every MoE layer's all-to-all ends when the slowest rank has reached it and the
largest transfer is done; the per-layer loads are means over layers, so the imbalance repeats
every layer. A pool step is, per MoE layer, ``max_r(pre) + max_r(dispatch) + max_r(experts) +
max_r(combine)`` (``pre``: attention, projections, router and shared experts), plus the dense
layers before the first all-to-all and the LM head after the last (each the slowest rank's).
Every rank's ``total_s`` is the pool's; what it did not spend busy is ``wait``.

DBO (``split``): each rank runs two micro-batches of half the counts (smaller GEMMs: a lower
``eff(M)`` and every weight read twice), and one micro-batch's all-to-all overlaps the
other's compute, scheduled stage by stage through the MoE layers (``dbo_pipeline.py``: at best
``max(sum of compute, sum of communication)`` per layer; worse when one micro-batch's chain of
stages is latency-bound), with compute slowed by the SMs normal-mode kernels occupy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from widellm.distributed.ep_context import default_fixed_capacity
from widellm.layers.moe.dispatch_all2all_fixed import step_capacity
from widellm.sim import links
from widellm.sim.dbo_pipeline import two_batch_pipeline
from widellm.sim.hardware import HardwareProfile
from widellm.sim.model_shape import DTYPE_BYTES, ModelShape
from widellm.sim.types import DeploymentShape, RankStepCost, RankStepLoad

# Kernels (GPU) or torch ops (CPU) per decoder layer part, counted from widellm's eager
# DeepSeek layer (norms, projections, rotary, cache store, attention, router top-k, dispatch
# pack/unpack, experts, combine) and rounded: an estimate, not a measurement.
KERNELS_PER_LAYER = {"attention": 16, "dense_mlp": 4, "moe": 14}
KERNELS_PER_STEP = 10  # embedding, final norm, LM head, sampling
# Activation passes (H- or I-wide reads and writes per row) of the memory-bound elementwise
# ops, counted from the layer's dataflow: two fused residual-add + RMSNorms per layer, each
# reading the residual and the branch output and writing both and the normed rows (5 passes);
# SiLU-and-mul reads gate and up and writes their product (3 I-wide passes); each routed copy
# is packed before dispatch (read + write), quantized or cast (read) and weighted in combine
# (read): 4 H-wide passes.
NORM_RESIDUAL_PASSES = 10
MLP_ACT_PASSES = 3
EXPERT_ROW_PASSES = 4
MICRO_BATCHES = 2
BREAKDOWN_KEYS = ("attention", "dense_gemm", "expert_gemm", "elementwise", "dispatch",
                  "combine", "launch", "wait", "exposed_comm", "hidden_comm", "host")


@dataclass(frozen=True, slots=True)
class _Parts:
    """One rank's (or one micro-batch's) seconds, per MoE layer unless named ``*_total``."""

    attention: float  # per layer (all layers alike)
    attn_proj: float  # per layer
    dense_mlp_total: float  # all dense layers' MLPs
    moe_local: float  # router + shared experts, per MoE layer
    experts: float  # per MoE layer
    dispatch: float  # per MoE layer
    combine: float  # per MoE layer
    lm_head: float
    elem_layer: float  # norms and residuals, per layer
    elem_dense: float  # a dense layer's activation function
    elem_moe: float  # an MoE layer's routed-copy and activation passes (in the expert stage)
    kernels: int


class AnalyticCostModel:
    """``CostModel`` for one pool; see the module docstring for the model."""

    def __init__(self, shape: ModelShape, profile: HardwareProfile,
                 deployment: DeploymentShape, weight_dtype: str = "fp8",
                 act_dtype: str = "bf16", kv_dtype: str = "bf16",
                 all2all_fixed_capacity: int | None = None) -> None:
        for name, value in (("weight_dtype", weight_dtype), ("act_dtype", act_dtype),
                            ("kv_dtype", kv_dtype)):
            if value not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}, got {value!r}")
        self.shape = shape
        self.deployment = deployment
        # Ranks sharing one host (CPU) split its compute and memory bandwidth.
        self.profile = (profile.shared_by(max(1, min(deployment.ranks_per_node,
                                                     deployment.num_ranks)))
                        if profile.ranks_share_host else profile)
        self.weight_dtype = weight_dtype
        self.act_dtype = act_dtype
        self.kv_dtype = kv_dtype
        # Expert slots per rank (routed experts plus EPLB's redundant ones, split over the
        # ranks); fixed for the deployment.
        self.local_experts = ((shape.n_routed_experts + deployment.num_redundant_experts)
                              / deployment.num_ranks if deployment.expert_parallel
                              else shape.n_routed_experts)
        self.rows_per_token = min(shape.top_k, int(self.local_experts))
        self.all2all_fixed_capacity = all2all_fixed_capacity or default_fixed_capacity(
            deployment.max_num_seqs, shape.top_k, int(self.local_experts))

    # --- one GEMM-like op ---------------------------------------------------------------
    def gemm_time(self, rows: float, params: float, dtype: str) -> float:
        """Roofline seconds of ``rows`` x ``params`` weights (2 FLOPs per weight per row)."""
        if rows <= 0 or params <= 0:
            return 0.0
        p = self.profile
        compute = 2.0 * rows * params / (p.peak_flops(dtype) * p.gemm_efficiency(rows))
        memory = params * DTYPE_BYTES[dtype] / (p.mem_bandwidth * p.gemm_mem_eff)
        return p.op_time(compute, memory)

    def attention_time(self, pairs: float, kv_tokens: float, flops_per_pair: int) -> float:
        """One layer's attention core: FLOPs of the pairs vs bytes of the KV read."""
        p = self.profile
        flops = pairs * flops_per_pair
        kv_bytes = kv_tokens * self.shape.kv_values_per_token * DTYPE_BYTES[self.kv_dtype]
        attn_dtype = "fp32" if self.kv_dtype in ("fp32", "float32") else "bf16"
        return p.op_time(flops / (p.peak_flops(attn_dtype) * p.attn_compute_eff),
                         kv_bytes / (p.mem_bandwidth * p.attn_mem_eff))

    # --- one rank ---------------------------------------------------------------------------
    def _parts(self, load: RankStepLoad, scale: float, mode: str, t_max: float) -> _Parts:
        s, wd = self.shape, self.weight_dtype
        rows = load.num_tokens * scale
        bf16 = "fp32" if wd == "fp32" else "bf16"
        dec_pairs, pre_pairs, dec_kv, pre_kv = _split_attention(load)
        attention = (self.attention_time(dec_pairs * scale, dec_kv * scale,
                                         s.flops_per_pair_decode)
                     + self.attention_time(pre_pairs * scale, pre_kv * scale,
                                           s.flops_per_pair_prefill)
                     + self.gemm_time(pre_kv * scale, s.kv_b_params, bf16))
        attn_proj = (self.gemm_time(rows, s.attn_proj_params - s.attn_bf16_params, wd)
                     + self.gemm_time(rows, s.attn_bf16_params, bf16))
        moe_local = (self.gemm_time(rows, s.router_params, bf16)
                     + self.gemm_time(rows, s.shared_expert_params, wd))
        recv, active = self._expert_rows(load)
        recv *= scale
        active = min(active, math.ceil(recv)) if recv > 0 else 0
        experts = 0.0
        p = self.profile
        if recv > 0 and p.expert_curve:
            local = self.local_experts
            experts = (local * s.expert_params * DTYPE_BYTES[wd]
                       * p.expert_seconds_per_byte(recv / local))
        elif recv > 0 and active > 0:
            compute = 2.0 * recv * s.expert_params / (
                p.peak_flops(wd) * p.gemm_efficiency(recv / active))
            weights = active * s.expert_params * DTYPE_BYTES[wd]
            experts = p.op_time(compute, weights / (p.mem_bandwidth * p.gemm_mem_eff))
        dispatch, combine = self._comm(load, scale, mode, t_max * scale)
        lm_rows = 0 if load.is_dummy else load.num_seqs * scale
        kernels = (s.num_layers * KERNELS_PER_LAYER["attention"]
                   + s.num_dense_layers * KERNELS_PER_LAYER["dense_mlp"]
                   + s.num_moe_layers * KERNELS_PER_LAYER["moe"] + KERNELS_PER_STEP)
        return _Parts(
            attention=attention, attn_proj=attn_proj,
            dense_mlp_total=s.num_dense_layers * self.gemm_time(rows, s.dense_mlp_params, wd),
            moe_local=moe_local, experts=experts, dispatch=dispatch, combine=combine,
            lm_head=self.gemm_time(lm_rows, s.lm_head_params, bf16), kernels=kernels,
            **self._elementwise(rows, recv),
        )

    def _elementwise(self, rows: float, recv: float) -> dict[str, float]:
        """Seconds of the memory-bound elementwise passes (see ``NORM_RESIDUAL_PASSES``)."""
        s, p = self.shape, self.profile
        per_value = DTYPE_BYTES[self.act_dtype] / (p.mem_bandwidth * p.gemm_mem_eff)
        dense_inter = s.dense_mlp_params / (3 * s.hidden)
        shared_inter = s.shared_expert_params / (3 * s.hidden)
        expert_inter = s.expert_params / (3 * s.hidden)
        return dict(
            elem_layer=rows * NORM_RESIDUAL_PASSES * s.hidden * per_value,
            elem_dense=rows * MLP_ACT_PASSES * dense_inter * per_value,
            elem_moe=(recv * (EXPERT_ROW_PASSES * s.hidden + MLP_ACT_PASSES * expert_inter)
                      + rows * MLP_ACT_PASSES * shared_inter) * per_value,
        )

    def _expert_rows(self, load: RankStepLoad) -> tuple[float, int]:
        """(rows this rank's experts compute, active local experts) per MoE layer."""
        s = self.shape
        if s.num_moe_layers == 0:
            return 0.0, 0
        local = self.local_experts
        recv, active = load.expert_recv_tokens, load.active_local_experts
        if recv <= 0 and load.num_tokens > 0 and not load.is_dummy:
            # The runner left the routing counts out: uniform routing, balanced ranks.
            recv = float(load.num_tokens * s.top_k)
        if recv > 0 and active <= 0:
            active = max(1, round(local * (1.0 - math.exp(-recv / local))))
        return recv, int(active)

    def _comm(self, load: RankStepLoad, scale: float, mode: str,
              t_max: float) -> tuple[float, float]:
        """Seconds of one MoE layer's dispatch and combine on this rank."""
        s, d, p = self.shape, self.deployment, self.profile
        if mode == links.LOCAL or s.num_moe_layers == 0:
            return 0.0, 0.0
        act = DTYPE_BYTES[self.act_dtype]
        d_row = links.dispatch_row_bytes(p, s.hidden, act)
        c_row = links.combine_row_bytes(p, s.hidden, act)
        if mode == links.ALLGATHER:
            gathered = t_max * (s.hidden * act + s.top_k * links.ROW_METADATA_BYTES)
            partial = t_max * s.hidden * links.FP32_BYTES
            return (links.allgather_time(p, gathered, d.num_ranks, d.ranks_per_node),
                    links.allgather_time(p, partial, d.num_ranks, d.ranks_per_node))
        intra, inter = self._copies(load)
        intra, inter = intra * scale, inter * scale
        if mode == links.NORMAL:
            nodes = math.ceil(d.num_ranks / d.ranks_per_node)
            inter *= links.node_dedup_factor(s.top_k, nodes)
        if mode == links.LOW_LATENCY and p.fixed_a2a_full_buffer:
            peers = d.num_ranks - 1
            on_node = min(d.ranks_per_node, d.num_ranks) - 1
            # Whole blocks: the capacity under graphs, else the engine's ``step_capacity``.
            block = (self.all2all_fixed_capacity if d.cuda_graphs else step_capacity(
                self.all2all_fixed_capacity, math.ceil(t_max), self.rows_per_token))
            intra, inter = on_node * block, (peers - on_node) * block
        f = p.a2a_in_pipeline_factor
        return (f * links.all_to_all_time(p, intra * d_row, inter * d_row, "dispatch",
                                          d.num_ranks),
                f * links.all_to_all_time(p, intra * c_row, inter * c_row, "combine",
                                          d.num_ranks))

    def _copies(self, load: RankStepLoad) -> tuple[float, float]:
        """Routed copies crossing this rank's intra- and inter-node links per MoE layer: the
        larger of what it sends and what it receives (the combine reverses both)."""
        s, d = self.shape, self.deployment
        sent_intra, sent_inter = load.sent_intra_node, load.sent_inter_node
        copies = load.num_tokens * s.top_k
        if sent_intra + sent_inter <= 0 and load.expert_recv_tokens <= 0 and copies > 0:
            _, sent_intra, sent_inter = links.uniform_copies_split(copies, d.num_ranks,
                                                                   d.ranks_per_node)
        own = max(0.0, copies - sent_intra - sent_inter)
        recv, _ = self._expert_rows(load)
        recv_remote = max(0.0, recv - own)
        sent = sent_intra + sent_inter
        if sent > 0:
            frac_intra = sent_intra / sent
        else:
            _, a, b = links.uniform_copies_split(1.0, d.num_ranks, d.ranks_per_node)
            frac_intra = a / (a + b) if a + b > 0 else 1.0
        return (max(sent_intra, recv_remote * frac_intra),
                max(sent_inter, recv_remote * (1.0 - frac_intra)))

    # --- transfers the simulator prices through the cost model -----------------------------
    def kv_transfer_s(self, num_tokens: int) -> float:
        """Seconds to pull ``num_tokens`` tokens of KV (all layers) from a prefill rank into
        this pool: one transfer over the inter-node link (P and D pools on separate nodes)."""
        num_bytes = num_tokens * self.shape.kv_bytes_per_token(self.kv_dtype)
        return links.point_to_point_time(self.profile, num_bytes, inter_node=True)

    def weight_move_s(self, num_bytes: float) -> float:
        """Seconds of an EPLB expert-weight move of ``num_bytes`` between two ranks of this
        pool (over the inter-node link when the pool spans nodes)."""
        d = self.deployment
        return links.point_to_point_time(self.profile, num_bytes,
                                         inter_node=d.num_ranks > d.ranks_per_node)

    # --- the pool ---------------------------------------------------------------------------
    def step(self, loads: Sequence[RankStepLoad], split: bool) -> list[RankStepCost]:
        if not loads:
            return []
        s, p = self.shape, self.profile
        decode_only = all(ld.num_prefill_tokens == 0 for ld in loads)
        mode = links.backend_mode(self.deployment.all2all_backend,
                                  self.deployment.num_ranks, decode_only)
        if not self.deployment.expert_parallel:
            mode = links.LOCAL
        t_max = max(ld.num_tokens for ld in loads)
        n_mb = MICRO_BATCHES if split else 1
        parts = [self._parts(ld, 1.0 / n_mb, mode, t_max) for ld in loads]
        normal_overlap = split and mode == links.NORMAL and p.num_sms > p.comm_sms_normal > 0
        slow = p.num_sms / (p.num_sms - p.comm_sms_normal) if normal_overlap else 1.0

        def pre(x: _Parts) -> float:
            return x.attention + x.attn_proj + x.moe_local + x.elem_layer

        def expert_stage(x: _Parts) -> float:
            return x.experts + x.elem_moe

        def dense_layers(x: _Parts) -> float:
            return (s.num_dense_layers * (x.attention + x.attn_proj + x.elem_layer + x.elem_dense)
                    + x.dense_mlp_total)

        n_moe = s.num_moe_layers
        if n_moe and split:
            moe_time = two_batch_pipeline(
                max(pre(x) for x in parts) * slow, max(x.dispatch for x in parts),
                max(expert_stage(x) for x in parts) * slow, max(x.combine for x in parts),
                n_moe).total_s
            head = n_mb * max(dense_layers(x) for x in parts)
        elif n_moe:
            moe_time = n_moe * (max(x.dispatch for x in parts) + max(expert_stage(x) for x in parts)
                                + max(x.combine for x in parts)) \
                + (n_moe - 1) * max(pre(x) for x in parts)
            head = max(dense_layers(x) + pre(x) for x in parts)
        else:
            moe_time, head = 0.0, n_mb * max(dense_layers(x) for x in parts)
        tail = n_mb * max(x.lm_head for x in parts)
        device = head + moe_time + tail
        graphs = self.deployment.cuda_graphs and decode_only
        kernels = n_mb * parts[0].kernels
        if not p.async_launch:
            launch = kernels * p.launch_eager_s
        elif graphs:
            launch = kernels * p.launch_graph_s
        else:
            launch = max(0.0, kernels * p.launch_eager_s - device)
        host = p.step_overhead_s + p.step_overhead_per_seq_s * max(ld.num_seqs for ld in loads)
        total = device + launch + host
        return [self._cost(x, n_mb, slow if split else 1.0, total, launch, host, moe_time)
                for x in parts]

    def _cost(self, x: _Parts, n_mb: int, slow: float, total: float, launch: float,
              host: float, moe_time: float) -> RankStepCost:
        s = self.shape
        attention = n_mb * s.num_layers * x.attention
        dense = n_mb * (s.num_layers * x.attn_proj + x.dense_mlp_total
                        + s.num_moe_layers * x.moe_local + x.lm_head)
        experts = n_mb * s.num_moe_layers * x.experts
        elementwise = n_mb * (s.num_layers * x.elem_layer + s.num_dense_layers * x.elem_dense
                              + s.num_moe_layers * x.elem_moe)
        dispatch = n_mb * s.num_moe_layers * x.dispatch
        combine = n_mb * s.num_moe_layers * x.combine
        comm = dispatch + combine
        if n_mb > 1:
            compute_moe = n_mb * s.num_moe_layers * (
                x.attention + x.attn_proj + x.moe_local + x.elem_layer + x.experts
                + x.elem_moe) * slow
            # What the pipeline took beyond this rank's compute waited on communication.
            exposed = min(comm, max(0.0, moe_time - compute_moe))
        else:
            exposed = comm
        busy = attention + dense + experts + elementwise + exposed + launch + host
        breakdown = {
            "attention": attention, "dense_gemm": dense, "expert_gemm": experts,
            "elementwise": elementwise,
            "dispatch": dispatch, "combine": combine, "launch": launch,
            "wait": max(0.0, total - busy), "exposed_comm": exposed,
            "hidden_comm": comm - exposed, "host": host,
        }
        return RankStepCost(total_s=total, breakdown=breakdown)


def _split_attention(load: RankStepLoad) -> tuple[float, float, float, float]:
    """(decode pairs, prefill pairs, decode KV tokens, prefill KV tokens). The load does not
    split them; a decode row's pairs equal its context (the KV it reads), and in a mixed step
    the decode rows' share of the KV read is taken as their share of the sequences."""
    pairs, kv = float(load.attn_score_pairs), float(load.attn_kv_read_tokens)
    if load.num_prefill_tokens == 0:
        return max(pairs, kv), 0.0, kv, 0.0
    if load.num_decode_tokens == 0:
        return 0.0, pairs, 0.0, kv
    share = load.num_decode_tokens / max(load.num_seqs, load.num_decode_tokens)
    dec_kv = kv * share
    return dec_kv, max(0.0, pairs - dec_kv), dec_kv, kv - dec_kv


def make_cost_model(hf_config: Any, profile: HardwareProfile, deployment: DeploymentShape,
                    weight_dtype: str = "fp8", **kwargs: Any) -> AnalyticCostModel:
    """The cost model of ``hf_config`` (HF config dict or object) on ``profile`` for one pool.
    ``kwargs``: ``act_dtype`` and ``kv_dtype`` (default "bf16", "fp32" for fp32 weights: the
    engine's ``--dtype``), ``all2all_fixed_capacity`` (rows per rank pair of widellm's
    fixed-capacity buffers, whole blocks on gloo; default: the engine's)."""
    default_act = "fp32" if weight_dtype == "fp32" else "bf16"
    kwargs.setdefault("act_dtype", default_act)
    kwargs.setdefault("kv_dtype", default_act)
    return AnalyticCostModel(ModelShape.from_hf_config(hf_config), profile, deployment,
                             weight_dtype=weight_dtype, **kwargs)


def kv_transfer_time(num_tokens: int, hf_config: Any, profile: HardwareProfile,
                     inter_node: bool = True, kv_dtype: str = "bf16") -> float:
    """Seconds to move ``num_tokens`` tokens' KV cache (all layers) from a prefill rank to a
    decode rank: one point-to-point transfer (P/D disaggregation)."""
    shape = ModelShape.from_hf_config(hf_config)
    num_bytes = num_tokens * shape.kv_bytes_per_token(kv_dtype)
    return links.point_to_point_time(profile, num_bytes, inter_node)
