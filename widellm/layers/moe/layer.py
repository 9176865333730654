"""FusedMoE: the routed-expert half of an MoE block (router -> dispatch -> experts -> combine).

The gate linear that produces ``router_logits`` and any shared experts belong to the model
file; this module owns the stacked routed-expert weights of the experts local to this rank.
``forward`` runs the stages (route, dispatch launch / send / wait, experts, combine launch /
wait) in order, with the model's shared experts inside the dispatch's last transfer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import nn

from widellm.distributed.ep_context import ExpertParallelContext
from widellm.eplb.placement import ExpertPlacement
from widellm.eplb.routing import logical_to_physical_ids
from widellm.forward_context import current_forward_context, dbo_yield
from widellm.layers.moe.dispatch import (
    SKIP_EXPERT_ID, DispatchedTokens, DispatchHandle, MoEDispatcher,
)
from widellm.layers.moe.experts import experts_forward
from widellm.layers.moe.experts_fp8 import SCALE_SUFFIX
from widellm.layers.moe.registry import make_dispatcher
from widellm.layers.moe.router import GroupScore, ScoringFunc, select_experts
from widellm.step_timer import StepTimer, maybe_phase

if TYPE_CHECKING:
    from widellm.eplb.stats import ExpertLoadRecorder
    from widellm.layers.moe.experts_fp8 import Fp8BlockExperts

ParamName = Literal["w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"]
ShardId = Literal["w1", "w3", "w2"]

# Checkpoint projection names of each shard: DeepSeek/Qwen style, then Mixtral style.
_CKPT_PROJ_TO_SHARD: Mapping[str, ShardId] = MappingProxyType(
    {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
)
_SHARD_TO_PARAM: Mapping[str, ParamName] = MappingProxyType(
    {"w1": "w13_weight", "w3": "w13_weight", "w2": "w2_weight"}
)
# "experts.<e>.<proj>.weight" at a module boundary, so "shared_experts.*" never matches.
_EXPERT_WEIGHT_RE = re.compile(
    r"(?:^|\.)(experts\.(\d+)\.(" + "|".join(_CKPT_PROJ_TO_SHARD) + r")\.weight)$"
)


class ExpertParamMapping(NamedTuple):
    """Where one checkpoint expert tensor goes.

    ``weight_name`` is the checkpoint name suffix (``"experts.3.gate_proj.weight"``).
    """

    param_name: ParamName
    weight_name: str
    expert_id: int
    shard_id: ShardId


@dataclass(frozen=True, eq=False)
class RoutingConfig:
    """Keyword arguments of :func:`select_experts` fixed per layer.

    Kept in a plain dataclass so that a bias tensor owned by the model's gate is referenced,
    not registered a second time as a parameter of this module.
    """

    scoring_func: ScoringFunc = "softmax"
    renormalize: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    group_score: GroupScore = "max"
    e_score_correction_bias: torch.Tensor | None = None
    routed_scaling_factor: float = 1.0


class FusedMoE(nn.Module):
    """Routed experts with stacked weights.

    Args:
        num_experts: global number of routed experts ``E``.
        top_k: experts per token.
        hidden_size: ``H``.
        intermediate_size: per-expert ``I``.
        scoring_func, renormalize, num_expert_group, topk_group, group_score,
            e_score_correction_bias, routed_scaling_factor: routing, as in
            :func:`select_experts`.
        dtype: dtype of the expert weights (and of the activations they take).
        device: device of the weights and of the dispatcher's ``expert_map``; build the
            layer on its final device, since ``Module.to`` does not move the dispatcher.
        dispatcher: registered dispatch backend name (single rank).
        expert_map: ``[E]`` int64 local index of each global expert or -1; all local if None.
        ep: expert parallelism; when given with more than one rank it overrides
            ``dispatcher`` and ``expert_map``: experts are split contiguously over the EP
            group and tokens move with ``ep.all2all_backend``.

    Parameters:
        w13_weight: ``[E_local, 2I, H]`` gate (w1) rows then up (w3) rows.
        w2_weight: ``[E_local, H, I]`` down projection.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        scoring_func: ScoringFunc = "softmax",
        renormalize: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        group_score: GroupScore = "max",
        e_score_correction_bias: torch.Tensor | None = None,
        routed_scaling_factor: float = 1.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        dispatcher: str = "local",
        expert_map: torch.Tensor | None = None,
        ep: ExpertParallelContext | None = None,
    ) -> None:
        super().__init__()
        backend_kwargs: dict = {}
        num_physical = num_experts
        # EPLB: the router's logical experts map onto physical slots (replicas of hot ones).
        self.placement: ExpertPlacement | None = None
        self._ep_rank = 0
        if ep is not None and ep.size > 1:
            num_physical = ep.num_physical(num_experts)
            expert_map = ep.expert_map(num_experts)
            dispatcher = ep.all2all_backend
            backend_kwargs = ep.dispatcher_kwargs(top_k, num_experts)
            self._ep_rank = ep.rank
            if ep.enable_eplb:
                self.placement = ExpertPlacement.initial(num_experts, num_physical, ep.size, device)
        if expert_map is None:
            expert_map = torch.arange(num_experts, dtype=torch.int64)
        if expert_map.shape != (num_physical,):
            raise ValueError(f"expert_map must have shape ({num_physical},), got {tuple(expert_map.shape)}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = RoutingConfig(
            scoring_func=scoring_func,
            renormalize=renormalize,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            group_score=group_score,
            e_score_correction_bias=e_score_correction_bias,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.dispatcher: MoEDispatcher = make_dispatcher(
            dispatcher, expert_map.to(device), **backend_kwargs
        )
        self.num_local_experts = self.dispatcher.num_local_experts
        # Host copy for weight loading, which must not sync the device per tensor: the local
        # slots each logical expert loads into (several with replicas, none when remote).
        phys_to_logical = (self.placement.phys_to_logical.tolist() if self.placement is not None
                           else list(range(num_physical)))
        self._logical_to_local: list[list[int]] = [[] for _ in range(num_experts)]
        for phys, local in enumerate(expert_map.tolist()):
            if local >= 0:
                self._logical_to_local[phys_to_logical[phys]].append(local)
        # Set by attach_load_recorder when EPLB measures expert load.
        self._load_recorder: ExpertLoadRecorder | None = None
        self._moe_layer_index = -1

        factory = {"dtype": dtype, "device": device}
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size, **factory),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, intermediate_size, **factory),
            requires_grad=False,
        )
        # The activations' dtype, which FP8 weights no longer tell.
        self.params_dtype = self.w13_weight.dtype
        # How the expert weights are held and computed: None for the plain weights above
        # (experts_forward); an Fp8BlockExperts (experts_fp8.py) for FP8 kept as loaded.
        self.experts_method: Fp8BlockExperts | None = None

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.num_local_experts}, top_k={self.top_k}, "
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"scoring_func={self.routing.scoring_func}"
        )

    @staticmethod
    def make_expert_params_mapping(
        num_experts: int,
        ckpt_gate_proj_name: str = "gate_proj",
        ckpt_up_proj_name: str = "up_proj",
        ckpt_down_proj_name: str = "down_proj",
    ) -> list[ExpertParamMapping]:
        """Every per-expert checkpoint tensor of one layer and where it loads.

        Pass ``"w1", "w3", "w2"`` for Mixtral checkpoints.
        """
        shards: tuple[tuple[str, ShardId], ...] = (
            (ckpt_gate_proj_name, "w1"),
            (ckpt_up_proj_name, "w3"),
            (ckpt_down_proj_name, "w2"),
        )
        return [
            ExpertParamMapping(_SHARD_TO_PARAM[shard], f"experts.{e}.{proj}.weight", e, shard)
            for e in range(num_experts)
            for proj, shard in shards
        ]

    @staticmethod
    def parse_expert_weight_name(name: str) -> ExpertParamMapping | None:
        """Recognise a per-expert checkpoint name of either convention.

        ``"model.layers.3.mlp.experts.7.up_proj.weight"`` ->
        ``ExpertParamMapping("w13_weight", "experts.7.up_proj.weight", 7, "w3")``; the module
        prefix is ``name[: -len(weight_name)]``. Returns None for any other name.
        """
        match = _EXPERT_WEIGHT_RE.search(name)
        if match is None:
            return None
        weight_name, expert, proj = match.groups()
        shard = _CKPT_PROJ_TO_SHARD[proj]
        return ExpertParamMapping(_SHARD_TO_PARAM[shard], weight_name, int(expert), shard)

    def is_local_expert(self, global_expert_id: int) -> bool:
        """Whether this rank holds ``global_expert_id`` (the loader skips the others)."""
        return bool(self._logical_to_local[global_expert_id])

    def expert_parameters(self) -> list[nn.Parameter]:
        """What EPLB moves between ranks, each ``[S, ...]`` by local slot: the stacked expert
        weights and, for FP8 experts, their block scales."""
        names = ["w13_weight", "w2_weight"]
        if self.experts_method is not None:
            names += [n + SCALE_SUFFIX for n in names]
        return [getattr(self, n) for n in names]

    def attach_load_recorder(self, recorder: ExpertLoadRecorder, moe_layer_index: int) -> None:
        """Count the tokens routed to each physical expert into ``recorder``'s row for this
        layer (EPLB)."""
        if self.placement is None:
            raise ValueError("expert load is recorded only with EPLB placement")
        self._load_recorder = recorder
        self._moe_layer_index = moe_layer_index

    def weight_loader(
        self, param_name: ParamName, loaded: torch.Tensor, global_expert_id: int, shard_id: ShardId
    ) -> bool:
        """Copy one checkpoint expert tensor into its slice.

        Args:
            param_name: ``"w13_weight"`` or ``"w2_weight"``, or their ``*_scale_inv`` when the
                experts keep FP8 weights (``experts_fp8.py``).
            loaded: ``[I, H]`` for w1 (gate_proj) and w3 (up_proj), ``[H, I]`` for w2
                (down_proj); a scale: its weight's block grid (``[I / 128, cdiv(H, 128)]``...).
            global_expert_id: the expert's index in the checkpoint.
            shard_id: ``"w1"``, ``"w3"`` or ``"w2"``.

        Returns:
            True if copied, False if the expert lives on another rank.
        """
        scale = param_name.endswith(SCALE_SUFFIX)
        if _SHARD_TO_PARAM.get(shard_id) != param_name.removesuffix(SCALE_SUFFIX):
            raise ValueError(f"shard {shard_id!r} does not belong to {param_name!r}")
        if scale and self.experts_method is None:
            raise ValueError(f"{param_name}: these experts hold no FP8 scales")
        if not 0 <= global_expert_id < self.num_experts:
            raise ValueError(f"expert {global_expert_id} out of range [0, {self.num_experts})")
        local_slots = self._logical_to_local[global_expert_id]
        inter = self.intermediate_size
        for local_id in local_slots:  # every replica of the expert held here
            if scale:
                rows = self.experts_method.scale_rows(self, shard_id)
                dst = getattr(self, param_name).data[local_id, rows]
            elif shard_id == "w2":
                dst = self.w2_weight.data[local_id]
            elif shard_id == "w1":
                dst = self.w13_weight.data[local_id, :inter]
            else:
                dst = self.w13_weight.data[local_id, inter:]
            if loaded.shape != dst.shape:
                raise ValueError(
                    f"expert {global_expert_id} {shard_id}: checkpoint shape "
                    f"{tuple(loaded.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(loaded)
        return bool(local_slots)

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Routed-expert output of each token, plus the shared experts' when given.

        The stages below run in order; the shared experts (local compute) run while the
        dispatch's rows travel (after ``dispatch_send``: ``all2all`` exchanges sizes first).
        After each launch the layer hands over to the other micro-batch under dual-batch
        overlap (``dbo_yield``), so this one function is also the op sequence DBO interleaves.

        Args:
            hidden_states: ``[T, H]`` in the weights' dtype; expert math stays in it.
            router_logits: ``[T, E]`` gate outputs; routing is done in fp32.
            padding_mask: optional ``[T]`` bool, True for padding rows, which get expert id -1
                and a zero output; defaults to the forward context's (dummy batches).
            shared_experts: ``[T, H] -> [T, H]``, added to the routed output.

        Returns:
            ``[T, H]`` in the dtype of ``hidden_states``.
        """
        topk_weights, topk_ids = self.route(hidden_states, router_logits, padding_mask)
        timer = _timer()
        with maybe_phase(timer, "moe_dispatch"):
            dispatch_handle = self.dispatch_launch(hidden_states, topk_ids, topk_weights)
        dbo_yield()  # dual-batch overlap: the other micro-batch computes while tokens travel
        with maybe_phase(timer, "moe_dispatch"):
            if self.dispatcher.dispatch_send(dispatch_handle):
                dbo_yield()  # the rows travel now
        shared = shared_experts(hidden_states) if shared_experts is not None else None
        with maybe_phase(timer, "moe_dispatch"):
            tokens = self.dispatcher.dispatch_wait(dispatch_handle)
        with maybe_phase(timer, "moe_experts"):
            expert_output = self.run_experts(tokens)
        with maybe_phase(timer, "moe_combine"):
            combine_handle = self.dispatcher.combine_launch(expert_output, dispatch_handle)
        dbo_yield()
        with maybe_phase(timer, "moe_combine"):
            routed = self.dispatcher.combine_wait(combine_handle)
        return routed if shared is None else routed + shared

    # ---- the stages of forward, for callers that interleave them ---------------------------

    def route(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] fp32, topk_ids [T, k] int64)``: the experts of each token, as
        physical ids under EPLB, -1 for padding rows."""
        if hidden_states.dtype != self.params_dtype:
            raise TypeError(
                f"hidden_states dtype {hidden_states.dtype} != expert weights {self.params_dtype}"
            )
        routing = self.routing
        topk_weights, topk_ids = select_experts(
            router_logits,
            self.top_k,
            scoring_func=routing.scoring_func,
            renormalize=routing.renormalize,
            num_expert_group=routing.num_expert_group,
            topk_group=routing.topk_group,
            group_score=routing.group_score,
            e_score_correction_bias=routing.e_score_correction_bias,
            routed_scaling_factor=routing.routed_scaling_factor,
        )
        ctx = current_forward_context()
        if padding_mask is None and ctx is not None:
            padding_mask = ctx.attn_metadata.padding_mask
        if padding_mask is not None:
            topk_ids = topk_ids.masked_fill(padding_mask.unsqueeze(-1), SKIP_EXPERT_ID)
        if self.placement is not None:
            # Logical -> one of its replicas; each rank starts its round-robin elsewhere so
            # small batches do not all land on replica 0.
            topk_ids = logical_to_physical_ids(
                topk_ids, self.placement.logical_to_phys,
                self.placement.logical_replica_count, offset=self._ep_rank,
            )
            if self._load_recorder is not None:
                self._load_recorder.record(self._moe_layer_index, topk_ids)
        return topk_weights, topk_ids

    def dispatch_launch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> DispatchHandle:
        """Start the dispatch with the token counts the step's vote agreed (if any)."""
        ctx = current_forward_context()
        dp = ctx.dp_metadata if ctx is not None else None
        counts = dp.num_tokens_across_dp if dp is not None else None
        return self.dispatcher.dispatch_launch(hidden_states, topk_ids, topk_weights, counts)

    def run_experts(self, tokens: DispatchedTokens) -> torch.Tensor:
        """``[N, H]`` unweighted outputs of the local experts for the dispatched rows."""
        if self.experts_method is not None:
            return self.experts_method.apply(self, tokens.hidden_states, tokens.expert_ids)
        return experts_forward(tokens.hidden_states, tokens.expert_ids, self.w13_weight,
                               self.w2_weight)


def _timer() -> StepTimer | None:
    ctx = current_forward_context()
    return ctx.step_timer if ctx is not None else None
