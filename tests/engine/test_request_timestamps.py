"""The engine core stamps requests on its own clock (queued on arrival, scheduled on first
admission) and the frontend turns them, with the batches' timestamps on that same clock, into
exact queue / prefill / decode / inference times. A virtual clock that only the forwards
advance makes every interval a known multiple of the forward time."""

from __future__ import annotations

from widellm.config import CacheConfig
from widellm.engine.arg_utils import EngineArgs
from widellm.engine.engine_core import EngineCore, EngineCoreRequest
from widellm.engine.iteration_stats import IterationStats
from widellm.engine.metrics import EngineMetrics
from widellm.engine.output_processor import OutputProcessor, RequestOutputKind
from widellm.sampling_params import SamplingParams
from widellm.worker.model_runner import ModelRunner

FORWARD_S = 0.25  # virtual seconds every forward takes
START_S = 100.0
MAX_TOKENS = 3
MODEL = "m"


def test_engine_clock_gives_exact_phase_times(model_dir):
    now = [START_S]

    class TimedRunner(ModelRunner):
        def run_model_input(self, *args, **kwargs):
            now[0] += FORWARD_S
            return super().run_model_input(*args, **kwargs)

    # One running request at a time: the second waits for the first to finish.
    config = EngineArgs(model=model_dir("LlamaForCausalLM"), dtype="float32", num_kv_blocks=16,
                        max_model_len=128, max_num_seqs=1).create_engine_config()
    core = EngineCore(config, runner_factory=TimedRunner, clock=lambda: now[0])
    proc = OutputProcessor(tokenizer=None)
    metrics = EngineMetrics(MODEL, 1, 128, CacheConfig())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            detokenize=False)
    for rid in ("r1", "r2"):
        proc.add_request(rid, None, [5, 6, 7], params, RequestOutputKind.DELTA)
        core.add_request(EngineCoreRequest(rid, [5, 6, 7], params, [], MAX_TOKENS, 0.0))
    try:
        while core.has_unfinished_requests():
            outputs = core.step()
            # What the core's process does: stamp the batch with the core's clock.
            it = IterationStats(0, now[0])
            proc.process_outputs(outputs, it)
            metrics.record_iteration(it)
    finally:
        core.shutdown()
    assert now[0] == START_S + 2 * MAX_TOKENS * FORWARD_S

    def histogram(name: str) -> tuple[float, float]:
        labels = {"model_name": MODEL, "engine": "0"}
        get = metrics.registry.get_sample_value
        return get(f"{name}_count", labels), get(f"{name}_sum", labels)

    # r1: queued and scheduled at the start; r2 waits for r1's three forwards.
    assert histogram("widellm:request_queue_time_seconds") == (2, 3 * FORWARD_S)
    # Prefill: one forward each; decode: the two forwards after the first token.
    assert histogram("widellm:request_prefill_time_seconds") == (2, 2 * FORWARD_S)
    assert histogram("widellm:request_decode_time_seconds") == (2, 4 * FORWARD_S)
    assert histogram("widellm:request_inference_time_seconds") == (2, 6 * FORWARD_S)
    assert histogram("widellm:request_time_per_output_token_seconds") == (2, 2 * FORWARD_S)
    assert histogram("widellm:inter_token_latency_seconds") == (4, 4 * FORWARD_S)
    assert histogram("widellm:iteration_tokens_total") == (6, 2 * (3 + MAX_TOKENS))
