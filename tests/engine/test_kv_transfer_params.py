"""``kv_transfer_params`` (in ``SamplingParams.extra_args``) checked against the instance's
KV connector before a request reaches the engine core."""

import re

import pytest

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.processor import InputProcessor
from widellm.kv_transfer.config import KVTransferConfig
from widellm.sampling_params import SamplingParams

PRODUCER = KVTransferConfig("TCPConnector", kv_role="kv_producer")
CONSUMER = KVTransferConfig("TCPConnector", kv_role="kv_consumer")
BOTH = KVTransferConfig("TCPConnector", kv_role="kv_both")
DECODE = {"do_remote_decode": True}
PREFILL = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h",
           "remote_port": 1, "remote_request_id": "p", "remote_block_ids": [1, 2]}


@pytest.fixture(scope="module")
def model_config(model_dir):
    return EngineArgs(model=model_dir("LlamaForCausalLM"), dtype="float32",
                      max_model_len=128).create_engine_config().model_config


@pytest.fixture
def processor(model_config):
    def make(kv_config: KVTransferConfig | None) -> InputProcessor:
        return InputProcessor(model_config, None, [0], kv_config)
    return make


def params(kv, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": kv}, **kw)


@pytest.mark.parametrize("kv_config,kv", [
    (PRODUCER, DECODE), (BOTH, DECODE), (CONSUMER, PREFILL), (BOTH, PREFILL),
    (PRODUCER, {"do_remote_decode": True, "do_remote_prefill": False}),
])
def test_valid_params_pass_through(processor, kv_config, kv):
    assert processor(kv_config).kv_transfer_params(params(kv), 1) is kv


@pytest.mark.parametrize("kv_config", [None, PRODUCER, CONSUMER])
@pytest.mark.parametrize("kv", [{}, {"do_remote_decode": False, "do_remote_prefill": False},
                                {"do_remote_decode": 0, "other": 1}])
def test_nothing_asked_is_none(processor, kv_config, kv):
    assert processor(kv_config).kv_transfer_params(params(kv), 1) is None


def test_no_extra_args_is_none(processor):
    p = processor(PRODUCER)
    assert p.kv_transfer_params(SamplingParams(max_tokens=4), 1) is None
    assert p.kv_transfer_params(SamplingParams(max_tokens=4, extra_args={"x": 1}), 1) is None
    assert p.kv_transfer_params(params(None), 1) is None


@pytest.mark.parametrize("kv_config,kv,n,message", [
    (None, DECODE, 1, "this instance runs no KV connector (start it with "
                      "--kv-transfer-config)"),
    (None, PREFILL, 1, "--kv-transfer-config"),
    (PRODUCER, PREFILL, 1, "do_remote_prefill needs a kv_consumer or kv_both instance; "
                           "this one is kv_producer"),
    (CONSUMER, DECODE, 1, "do_remote_decode needs a kv_producer or kv_both instance; "
                          "this one is kv_consumer"),
    (BOTH, {**PREFILL, "do_remote_decode": True}, 1,
     "do_remote_prefill and do_remote_decode cannot both be set"),
    (PRODUCER, DECODE, 2, "n > 1 is not supported with a remote prefill or decode"),
    (CONSUMER, PREFILL, 3, "n > 1 is not supported"),
    (PRODUCER, "do_remote_decode", 1, "kv_transfer_params: must be an object"),
    (PRODUCER, [DECODE], 1, "kv_transfer_params: must be an object"),
])
def test_refused(processor, kv_config, kv, n, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        processor(kv_config).kv_transfer_params(params(kv), n)


def test_core_requests_carry_the_params(processor):
    kv = dict(PREFILL)
    reqs = processor(CONSUMER).make_core_requests("req", [5, 6, 7], params(kv), ["req-0"])
    assert [(r.request_id, r.kv_transfer_params) for r in reqs] == [("req-0", kv)]
    with pytest.raises(ValueError, match=re.escape("n > 1 is not supported")):
        processor(CONSUMER).make_core_requests("req", [5, 6, 7], params(kv, n=2),
                                               ["req-0", "req-1"])
    plain = processor(None).make_core_requests("q", [5], SamplingParams(max_tokens=2), ["q-0"])
    assert plain[0].kv_transfer_params is None


def test_prompt_logprobs_with_a_remote_prefill_is_refused(processor):
    """The decode side would never see the logits of the prompt positions it loads."""
    with pytest.raises(ValueError, match=re.escape("prompt logprobs need the prompt computed "
                                                   "here")):
        processor(CONSUMER).kv_transfer_params(params(PREFILL, prompt_logprobs=1), 1)
    # A prefill instance computes the prompt itself: it may return them.
    assert processor(PRODUCER).kv_transfer_params(params(DECODE, prompt_logprobs=1), 1) is DECODE
