"""The scheduler without a model, for the core tests: small blocks, requests with a known EOS,
and hand-made runner outputs standing in for the sampler."""

from widellm.config import CacheConfig, SchedulerConfig
from widellm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from widellm.core.request import Request
from widellm.core.scheduler import Scheduler
from widellm.core.scheduler_output import SchedulerOutput
from widellm.sampling_params import SamplingParams

# Small blocks keep the block arithmetic checkable by hand.
BLOCK_SIZE = 4
EOS = 2
# What the fake sampler returns unless a test picks a token: an ordinary, non-stopping id.
TOKEN = 7
STOP_TOKEN = 9
# Bounds the drain loop so a scheduling bug fails the test instead of hanging it.
MAX_STEPS = 200


def make_scheduler(
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


def make_request(req_id: str, prompt: list[int], max_tokens: int = 16, **params) -> Request:
    return Request(
        req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}), max_tokens=max_tokens,
    )


def fake_runner_output(
    sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int] | None = None
) -> ModelRunnerOutput:
    """Samples one token for every request whose scheduled tokens reach the end of its known
    tokens, and nothing for partial prefill chunks, as the model runner does."""
    sampled = sampled or {}
    req_ids = list(out.num_scheduled_tokens)
    tokens = []
    for req_id in req_ids:
        req = sched.requests.get(req_id)  # None once aborted; the runner still sampled it
        reached_end = req is None or req.num_computed_tokens == req.num_tokens
        tokens.append([sampled.get(req_id, TOKEN)] if reached_end else [])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, tokens)


def step(
    sched: Scheduler, sampled: dict[str, int] | None = None
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    out = sched.schedule()
    outputs = sched.update_from_output(out, fake_runner_output(sched, out, sampled))
    return out, {o.request_id: o for o in outputs}


def all_blocks_free(sched: Scheduler) -> bool:
    pool = sched.kv_cache_manager.block_pool
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
