"""The request-level metrics end to end inside the frontend: engine outputs with hand-picked
engine-core timestamps go through the OutputProcessor into IterationStats and EngineMetrics,
and every histogram, counter and label comes out with exact values."""

from __future__ import annotations

import pytest

from widellm.config import CacheConfig
from widellm.core.outputs import EngineCoreOutput
from widellm.engine.iteration_stats import IterationStats
from widellm.engine.metrics import EngineMetrics
from widellm.engine.output_processor import OutputProcessor, RequestOutputKind
from widellm.sampling_params import SamplingParams

MODEL = "m"
MAX_MODEL_LEN = 512
NUM_ENGINES = 2
# Three requests on engine 0: prompt lengths, and (queued_ts, scheduled_ts) on the core's
# clock. Binary-exact values, so sums compare with ==.
PROMPTS = {"a": 4, "b": 6, "c": 8}
QUEUED = {"a": (10.0, 10.25), "b": (10.0, 10.5), "c": (10.5, 10.75)}
# Batch timestamps: every request's first token, second token, third (last) token.
BATCH_TS = (11.0, 11.5, 12.5)
MAX_TOKENS = 3


def _value(metrics: EngineMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    assert value is not None, (name, labels)
    return value


def _histogram(metrics: EngineMetrics, name: str, engine: str = "0") -> tuple[float, float]:
    return (_value(metrics, f"{name}_count", engine=engine),
            _value(metrics, f"{name}_sum", engine=engine))


def _run_batch(proc, metrics, engine, ts, outputs) -> IterationStats:
    it = IterationStats(engine, ts)
    proc.process_outputs(outputs, it)
    metrics.record_iteration(it)
    return it


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(MODEL, NUM_ENGINES, MAX_MODEL_LEN, CacheConfig())


def test_three_requests_give_exact_histograms(metrics):
    proc = OutputProcessor(tokenizer=None)
    for rid, n in PROMPTS.items():
        proc.add_request(rid, None, list(range(1, n + 1)),
                         SamplingParams(max_tokens=MAX_TOKENS, detokenize=False),
                         RequestOutputKind.DELTA)
    first = [EngineCoreOutput(rid, [7], queued_ts=q, scheduled_ts=s)
             for rid, (q, s) in QUEUED.items()]
    it = _run_batch(proc, metrics, 0, BATCH_TS[0], first)
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (18, 3)  # prompts count here
    _run_batch(proc, metrics, 0, BATCH_TS[1], [EngineCoreOutput(r, [8]) for r in PROMPTS])
    _run_batch(proc, metrics, 0, BATCH_TS[2],
               [EngineCoreOutput(r, [9], finish_reason="length") for r in PROMPTS])
    assert not proc.has_unfinished_requests()

    assert _value(metrics, "widellm:prompt_tokens_total", engine="0") == 18
    assert _value(metrics, "widellm:generation_tokens_total", engine="0") == 9
    # Three batches: 18 prompt + 3 generated, then 3, then 3.
    assert _histogram(metrics, "widellm:iteration_tokens_total") == (3, 27)
    assert _histogram(metrics, "widellm:request_prompt_tokens") == (3, 18)
    assert _histogram(metrics, "widellm:request_generation_tokens") == (3, 9)
    assert _histogram(metrics, "widellm:request_params_max_tokens") == (3, 9)
    assert _histogram(metrics, "widellm:request_params_n") == (3, 3)
    assert _histogram(metrics, "widellm:request_max_num_generation_tokens") == (3, 9)
    # Queue: scheduled - queued; prefill: first token batch - scheduled; decode: last - first
    # token batch; inference: last token batch - scheduled; TPOT: decode / 2 tokens after
    # the first; inter-token gaps: 0.5 and 1.0 per request.
    assert _histogram(metrics, "widellm:request_queue_time_seconds") == (3, 1.0)
    assert _histogram(metrics, "widellm:request_prefill_time_seconds") == (3, 1.5)
    assert _histogram(metrics, "widellm:request_decode_time_seconds") == (3, 4.5)
    assert _histogram(metrics, "widellm:request_inference_time_seconds") == (3, 6.0)
    assert _histogram(metrics, "widellm:request_time_per_output_token_seconds") == (3, 2.25)
    assert _histogram(metrics, "widellm:inter_token_latency_seconds") == (6, 4.5)
    # Frontend clock: one first-token latency and one end-to-end latency per request.
    assert _histogram(metrics, "widellm:time_to_first_token_seconds")[0] == 3
    assert _histogram(metrics, "widellm:e2e_request_latency_seconds")[0] == 3
    success = {r: _value(metrics, "widellm:request_success_total", engine="0",
                         finished_reason=r) for r in ("stop", "length", "abort", "error")}
    assert success == {"stop": 0, "length": 3, "abort": 0, "error": 0}
    # Engine 1 served nothing: its series exist, at zero.
    assert _histogram(metrics, "widellm:request_queue_time_seconds", engine="1") == (0, 0)
    assert _value(metrics, "widellm:prompt_tokens_total", engine="1") == 0


def test_n_samples_error_and_abort_carry_the_engine_label(metrics):
    proc = OutputProcessor(tokenizer=None)
    ids = proc.add_request("p", None, [1, 2], SamplingParams(n=2, max_tokens=4,
                                                              detokenize=False),
                           RequestOutputKind.DELTA)
    _run_batch(proc, metrics, 1, 5.0, [
        EngineCoreOutput(ids[0], [3], queued_ts=4.0, scheduled_ts=4.5),
        EngineCoreOutput(ids[1], [3], queued_ts=4.0, scheduled_ts=4.5)])
    _run_batch(proc, metrics, 1, 6.0, [
        EngineCoreOutput(ids[0], [4], finish_reason="stop"),
        EngineCoreOutput(ids[1], [4])])
    _run_batch(proc, metrics, 1, 7.0, [EngineCoreOutput(ids[1], [5], finish_reason="length")])
    # Each sample is a request; n and the longest sample once for the parent.
    assert _value(metrics, "widellm:prompt_tokens_total", engine="1") == 4
    assert _histogram(metrics, "widellm:request_generation_tokens", "1") == (2, 5)
    assert _histogram(metrics, "widellm:request_params_n", "1") == (1, 2)
    assert _histogram(metrics, "widellm:request_max_num_generation_tokens", "1") == (1, 3)
    assert _histogram(metrics, "widellm:request_decode_time_seconds", "1") == (2, 3.0)
    assert _histogram(metrics, "widellm:request_time_per_output_token_seconds", "1") == (2, 2.0)

    # A request the engine ended before scheduling it (e.g. a grammar that failed to
    # compile): an error, with no phase times.
    proc.add_request("e", None, [1], SamplingParams(detokenize=False), RequestOutputKind.DELTA)
    _run_batch(proc, metrics, 1, 8.0, [EngineCoreOutput("e", [], finish_reason="error")])
    assert _value(metrics, "widellm:request_success_total", engine="1",
                  finished_reason="error") == 1
    assert _histogram(metrics, "widellm:request_queue_time_seconds", "1") == (2, 1.0)
    assert _histogram(metrics, "widellm:e2e_request_latency_seconds", "1")[0] == 3

    # A client that goes away: each unfinished sequence counts as an abort on its engine.
    ids = proc.add_request("q", None, [1], SamplingParams(n=2, detokenize=False),
                           RequestOutputKind.DELTA)
    _run_batch(proc, metrics, 1, 9.0, [EngineCoreOutput(ids[0], [3], finish_reason="length")])
    core_ids = proc.abort_requests(["q"])
    assert core_ids == [ids[1]]
    metrics.record_aborted(1, len(core_ids))
    metrics.record_aborted(None, 1)  # cut before it was routed
    assert _value(metrics, "widellm:request_success_total", engine="1",
                  finished_reason="abort") == 1
    assert _value(metrics, "widellm:request_success_total", engine="none",
                  finished_reason="abort") == 1


def test_cache_config_info_and_process_collectors(metrics):
    metrics.record_kv_blocks({0: 100, 1: 96})
    info = {"block_size": "16", "enable_prefix_caching": "True", "kv_cache_memory": "None",
            "kv_cache_memory_fraction": "0.25"}
    assert _value(metrics, "widellm:cache_config_info", engine="0", num_kv_blocks="100",
                  **info) == 1
    assert _value(metrics, "widellm:cache_config_info", engine="1", num_kv_blocks="96",
                  **info) == 1
    names = {m.name for m in metrics.registry.collect()}
    assert {"process_cpu_seconds", "python_info", "python_gc_objects_collected"} <= names


def test_the_benchmarks_switch_leaves_only_the_new_histograms_out():
    """benchmarks/metrics_cost.sh's baseline: the histograms vLLM's V1 set added stay at
    zero; the counters and latencies that existed before still count."""
    metrics = EngineMetrics(MODEL, 1, MAX_MODEL_LEN, request_histograms=False)
    proc = OutputProcessor(tokenizer=None)
    proc.add_request("a", None, [1, 2], SamplingParams(max_tokens=1, detokenize=False),
                     RequestOutputKind.DELTA)
    _run_batch(proc, metrics, 0, 2.0, [EngineCoreOutput("a", [5], finish_reason="length",
                                                        queued_ts=1.0, scheduled_ts=1.5)])
    assert _value(metrics, "widellm:prompt_tokens_total", engine="0") == 2
    assert _value(metrics, "widellm:request_success_total", engine="0",
                  finished_reason="length") == 1
    assert _histogram(metrics, "widellm:e2e_request_latency_seconds")[0] == 1
    assert _histogram(metrics, "widellm:time_to_first_token_seconds")[0] == 1
    for name in ("widellm:request_queue_time_seconds", "widellm:request_prompt_tokens",
                 "widellm:iteration_tokens_total", "widellm:request_params_n"):
        assert _histogram(metrics, name) == (0, 0), name
