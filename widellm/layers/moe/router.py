"""Top-k expert selection (the MoE router after its gate linear).

One pure function, :func:`select_experts`, covers the routing of the MoE families that widellm
loads. Following the DeepSeek-V3 paper (section 2.1.2), for a token ``t`` with router logits
``u_t = W_gate h_t``:

1. Affinity scores ``s_{i,t}``: ``softmax(u_t)`` (Mixtral, Qwen-MoE, DeepSeek-V2) or
   ``sigmoid(u_t)`` (DeepSeek-V3).
2. Selection scores ``s_{i,t} + b_i``: the score-correction bias ``b`` (auxiliary-loss-free
   load balancing) shifts which experts are *chosen* but never the gate values.
3. Group-limited routing: experts are split into ``num_expert_group`` equal, contiguous groups;
   each group is scored (``max`` of its selection scores for DeepSeek-V2, sum of its top-2 for
   DeepSeek-V3) and only the best ``topk_group`` groups stay eligible.
4. Top-k: the ``top_k`` eligible experts with the highest selection scores.
5. Gate values ``g'_{i,t} = s_{i,t}`` of the chosen experts (unbiased scores).
6. Optional renormalisation ``g = g' / sum(g')`` over the chosen experts.
7. Multiplication by ``routed_scaling_factor``.

Where HF applies these for each family (the configuration a model file should pass):

=============  ========  ===========  ===========================  =====================
family         scoring   renormalize  groups (group_score)         routed_scaling_factor
=============  ========  ===========  ===========================  =====================
Mixtral        softmax   True         none                         1.0
Qwen2-MoE      softmax   norm_topk    none                         1.0
Qwen3-MoE      softmax   norm_topk    none                         1.0
DeepSeek-V2    softmax   False (*)    group_limited_greedy (max)   config value
DeepSeek-V3    sigmoid   norm_topk    n_group / topk_group (top2)  config value
=============  ========  ===========  ===========================  =====================

(*) HF's DeepSeek-V2 router never renormalises and always scales. The original DeepSeek-V2
remote code instead renormalises *without* scaling when ``norm_topk_prob`` is set; a model
file reproduces that with ``renormalize=True, routed_scaling_factor=1.0``.
"""

from __future__ import annotations

from typing import Literal

import torch

ScoringFunc = Literal["softmax", "sigmoid"]
GroupScore = Literal["max", "top2_sum"]

SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")
GROUP_SCORES: tuple[str, ...] = ("max", "top2_sum")

# Added to the renormalisation denominator as DeepSeek-V3 does; far below one ulp of any
# achievable sum (the top-1 softmax score alone is >= 1/E), so it only guards against a
# row whose sigmoid scores all underflow to zero.
RENORM_EPS = 1e-20
# DeepSeek-V3 scores a group by the sum of its two best experts.
_TOP2 = 2


def _check_routing_args(
    num_experts: int,
    top_k: int,
    scoring_func: str,
    num_expert_group: int | None,
    topk_group: int | None,
    group_score: str,
    e_score_correction_bias: torch.Tensor | None,
) -> None:
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if e_score_correction_bias is not None and e_score_correction_bias.shape != (num_experts,):
        raise ValueError(
            f"e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}, "
            f"expected ({num_experts},)"
        )
    if num_expert_group is None:
        return
    if num_expert_group < 1 or num_experts % num_expert_group != 0:
        raise ValueError(f"num_expert_group={num_expert_group} must divide num_experts={num_experts}")
    if topk_group is None or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
    group_size = num_experts // num_expert_group
    if top_k > topk_group * group_size:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * group_size} experts in the kept groups")
    if group_score == "top2_sum" and group_size < _TOP2:
        raise ValueError("group_score='top2_sum' needs at least 2 experts per group")


def _group_limited_mask(
    choice_scores: torch.Tensor, num_expert_group: int, topk_group: int, group_score: str
) -> torch.Tensor:
    """Eligibility mask of group-limited routing.

    Args:
        choice_scores: ``[T, E]`` fp32 selection scores (biased when a bias is used).

    Returns:
        ``[T, E]`` bool, True for experts in one of the ``topk_group`` best groups.
    """
    num_tokens, num_experts = choice_scores.shape
    grouped = choice_scores.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    if group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(_TOP2, dim=-1).values.sum(dim=-1)
    # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_idx, True)
    return group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: ScoringFunc,
    renormalize: bool,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    group_score: GroupScore = "max",
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token and their gate weights (steps 1-7 above).

    Args:
        router_logits: ``[T, E]`` gate outputs; computed on in fp32 whatever their dtype.
        top_k: experts per token.
        scoring_func: ``"softmax"`` or ``"sigmoid"`` affinity.
        renormalize: divide the chosen gate values by their sum.
        num_expert_group: number of expert groups for group-limited routing (None: off).
        topk_group: groups kept per token when grouping is on.
        group_score: ``"max"`` (DeepSeek-V2) or ``"top2_sum"`` (DeepSeek-V3) group score.
        e_score_correction_bias: ``[E]`` bias added to the scores for selection only.
        routed_scaling_factor: final multiplier of the gate values.

    Returns:
        ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)``. The order of the k columns is
        unspecified; only the (id, weight) pairs are meaningful.
    """
    num_experts = router_logits.shape[-1]
    _check_routing_args(
        num_experts, top_k, scoring_func, num_expert_group, topk_group, group_score,
        e_score_correction_bias,
    )
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()

    choice_scores = scores
    if e_score_correction_bias is not None:
        choice_scores = scores + e_score_correction_bias.float()
    if num_expert_group is not None and topk_group is not None and topk_group < num_expert_group:
        eligible = _group_limited_mask(choice_scores, num_expert_group, topk_group, group_score)
        # -inf (not 0) so that a biased score below zero in a kept group still wins.
        choice_scores = choice_scores.masked_fill(~eligible, float("-inf"))

    topk_ids = torch.topk(choice_scores, k=top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids
