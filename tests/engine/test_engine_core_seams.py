"""The engine core's seams for a simulator (issue 26): it takes its model runner from a
factory and its time from a clock, so a simulated runner and a virtual clock can drive the
real scheduler. Here the real runner comes through a factory that records its calls, and a
virtual clock, advanced only by the runner's forwards, gives every step's duration exactly."""

from __future__ import annotations

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.engine_core import EngineCore, EngineCoreRequest
from widellm.sampling_params import SamplingParams
from widellm.worker.model_runner import ModelRunner

FORWARD_S = 0.25  # virtual seconds every forward takes


class VirtualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_runner_factory_and_clock_are_the_engine_cores(model_dir):
    clock = VirtualClock()
    built = []

    class TimedRunner(ModelRunner):
        def run_model_input(self, *args, **kwargs):
            clock.now += FORWARD_S
            return super().run_model_input(*args, **kwargs)

    def factory(config, ep, step_timer):
        built.append((ep, step_timer))
        return TimedRunner(config, ep, step_timer)

    config = EngineArgs(model=model_dir("LlamaForCausalLM"), dtype="float32",
                        num_kv_blocks=16, max_model_len=128).create_engine_config()
    core = EngineCore(config, runner_factory=factory, clock=clock)
    assert built == [(None, None)] and isinstance(core.model_runner, TimedRunner)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(temperature=0),
                                       [], 3, 0.0))
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
        assert core.last_step_duration_s == FORWARD_S
    assert len(tokens) == 3 and core.num_steps == 3
    assert clock.now == 100.0 + 3 * FORWARD_S
    core.shutdown()
