"""The sampling surface without a server: prompt_logprobs and echo with max_tokens 0 as
SamplingParams, the --max-logprobs cap, generation-config defaults, --chat-template,
continue_final_message rendering, /tokenizer_info's content and several served names."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.generation_config import default_sampling_params
from widellm.engine.processor import InputProcessor
from widellm.engine.tokenizer import get_tokenizer
from widellm.entrypoints.chat_template import load_chat_template
from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import (
    MAX_LOGPROBS, CompletionRequest, PromptLogprob, prompt_logprobs_response,
)
from widellm.entrypoints.protocol_chat import ChatCompletionRequest, TokenizeRequest
from widellm.entrypoints.serving_base import tokenizer_executor
from widellm.entrypoints.serving_tokenization import OpenAIServingTokenization
from widellm.model.preset_tokenizer import CHAT_TEMPLATE
from widellm.outputs import Logprob

MODEL_ARCH = "LlamaForCausalLM"
MAX_MODEL_LEN = 64
MESSAGES = [{"role": "user", "content": "hi"}]
CONTINUED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
SERVER_TEMPLATE = "{% for m in messages %}({{ m['role'] }}:{{ m['content'] }}){% endfor %}"


@pytest.fixture
def tokenizer(model_dir):
    return get_tokenizer(model_dir(MODEL_ARCH))


def _serving(tokenizer, executor, **options) -> OpenAIServingTokenization:
    model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN,
                                   hf_config=SimpleNamespace(vocab_size=len(tokenizer)))
    engine = SimpleNamespace(model_config=model_config, tokenizer=tokenizer,
                             processor=InputProcessor(model_config, tokenizer, []))
    return OpenAIServingTokenization(engine, ["tiny"], 1, executor=executor, **options)


def _chat_ids(serving, **fields) -> list[int]:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})
    return asyncio.run(serving.chat_prompt_ids(request, validate=False))


# ---- prompt_logprobs, echo with max_tokens 0, --max-logprobs ---------------------------------

def test_prompt_logprobs_reach_sampling_params_on_both_endpoints():
    assert CompletionRequest(prompt="x", prompt_logprobs=3).to_sampling_params(
    ).prompt_logprobs == 3
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "prompt_logprobs": 0})
    assert chat.to_sampling_params().prompt_logprobs == 0


def test_echo_with_max_tokens_0_computes_the_prompt_only():
    p = CompletionRequest(prompt="x", echo=True, max_tokens=0, logprobs=2).to_sampling_params()
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs) == (0, 2, 2)
    # Without logprobs the engine still needs the prompt computed: it asks for the token only.
    p = CompletionRequest(prompt="x", echo=True, max_tokens=0).to_sampling_params()
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs) == (0, None, 0)


def test_max_tokens_0_without_echo_is_refused():
    for fields in ({}, {"prompt_logprobs": 1}):
        with pytest.raises(ValueError, match="^max_tokens must be >= 1, got 0$"):
            CompletionRequest(prompt="x", max_tokens=0, **fields).to_sampling_params()


def test_echo_asks_for_the_larger_of_logprobs_and_prompt_logprobs():
    p = CompletionRequest(prompt="x", echo=True, logprobs=2,
                          prompt_logprobs=4).to_sampling_params()
    assert p.prompt_logprobs == 4


def _request(endpoint: str, fields: dict):
    if endpoint == "completions":
        return CompletionRequest.model_validate({"prompt": "x", **fields})
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("endpoint, fields, message", [
    ("completions", {"logprobs": 4}, "logprobs must be <= 3, got 4"),
    ("completions", {"prompt_logprobs": 4}, "prompt_logprobs must be <= 3, got 4"),
    ("chat", {"logprobs": True, "top_logprobs": 4}, "top_logprobs must be in [0, 3], got 4"),
    ("chat", {"prompt_logprobs": 4}, "prompt_logprobs must be <= 3, got 4"),
])
def test_the_logprobs_cap_names_the_field(endpoint, fields, message):
    request = _request(endpoint, fields)
    request.to_sampling_params(max_logprobs=4)  # at the cap: fine
    with pytest.raises(ValueError) as err:
        request.to_sampling_params(max_logprobs=3)
    assert str(err.value) == message


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_cannot_stream(endpoint):
    request = _request(endpoint, {"prompt_logprobs": 1, "stream": True})
    with pytest.raises(ValueError, match="^prompt_logprobs: not available with stream=true$"):
        request.to_sampling_params()


def test_prompt_logprobs_response_keeps_the_token_and_the_top_n():
    position = {7: Logprob(-3.0, 5, "a"), 2: Logprob(-0.5, 1, "b"), 9: Logprob(-1.0, 2, "c")}
    assert prompt_logprobs_response([4, 7], [None, position], 1) == [None, {
        7: PromptLogprob(logprob=-3.0, rank=5, decoded_token="a"),
        2: PromptLogprob(logprob=-0.5, rank=1, decoded_token="b")}]


# ---- generation-config defaults ----------------------------------------------------------------

def _folder(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_model_folder_and_vllm_ignores_it(tmp_path):
    folder = _folder(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                "repetition_penalty": 1.1, "max_new_tokens": 7,
                                "do_sample": True, "eos_token_id": 2})
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                "repetition_penalty": 1.1, "max_tokens": 7}
    assert default_sampling_params("auto", folder) == expected
    assert default_sampling_params(folder, "/nonexistent") == expected
    assert default_sampling_params("vllm", folder) == {}
    assert default_sampling_params("vllm", folder, '{"temperature": 0.2}') == {
        "temperature": 0.2}
    assert default_sampling_params("auto", folder, {"max_new_tokens": 3})["max_tokens"] == 3


@pytest.mark.parametrize("source, override, message", [
    ("auto", '{"temprature": 1}', "override_generation_config: unknown keys ['temprature']"),
    ("auto", "{", "override_generation_config: not valid JSON"),
    ("auto", '{"top_p": 0}', "generation_config: a default is invalid: top_p must be in"),
    ("nowhere", None, "generation_config: 'nowhere' is not auto, vllm or a folder"),
])
def test_bad_generation_configs_fail_at_start_up(tmp_path, source, override, message):
    folder = _folder(tmp_path, {})
    with pytest.raises(ValueError) as err:
        default_sampling_params(source, folder, override)
    assert str(err.value).startswith(message)


def test_defaults_fill_only_what_a_request_leaves_unset():
    defaults = {"temperature": 0.0, "top_k": 5, "max_tokens": 9}
    p = CompletionRequest(prompt="x").to_sampling_params(default_sampling_params=defaults)
    assert (p.temperature, p.max_tokens) == (0.0, 9)
    p = CompletionRequest(prompt="x", temperature=0.7, top_k=3,
                          max_tokens=2).to_sampling_params(default_sampling_params=defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.7, 3, 2)
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    p = chat.to_sampling_params(default_sampling_params=defaults)
    assert (p.temperature, p.max_tokens) == (0.0, 9)
    # Without defaults: OpenAI's (16 for completions, the context for chat).
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16
    assert chat.to_sampling_params().max_tokens is None


# ---- chat templates: --chat-template, continue_final_message, reasoning_effort ---------------

def test_chat_template_flag_takes_a_file_or_inline_text(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(SERVER_TEMPLATE)
    assert load_chat_template(str(path)) == SERVER_TEMPLATE
    assert load_chat_template(SERVER_TEMPLATE) == SERVER_TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="is neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_the_server_template_replaces_the_models(tokenizer):
    with tokenizer_executor() as pool:
        ids = _chat_ids(_serving(tokenizer, pool, chat_template=SERVER_TEMPLATE))
    assert tokenizer.decode(ids) == "(user:hi)"


def test_continue_final_message_leaves_the_answer_open(tokenizer):
    with tokenizer_executor() as pool:
        serving = _serving(tokenizer, pool)
        request = ChatCompletionRequest.model_validate({
            "messages": CONTINUED, "continue_final_message": True,
            "add_generation_prompt": False})
        ids = asyncio.run(serving.chat_prompt_ids(request, validate=False))
    assert tokenizer.decode(ids) == "<|user|>\nhi\n<|assistant|>\nThe answer"


def test_continue_final_message_needs_an_assistant_message_last(tokenizer):
    serving = _serving(tokenizer, executor=None)
    request = ChatCompletionRequest.model_validate({
        "messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False})
    with pytest.raises(APIError) as err:
        asyncio.run(serving.chat_prompt_ids(request, validate=False))
    assert (err.value.status, err.value.param) == (400, "continue_final_message")
    assert err.value.message == ("continue_final_message: the last message must be the "
                                 "assistant's, got role 'user'")
    empty = TokenizeRequest.model_validate({"messages": [], "continue_final_message": True,
                                            "add_generation_prompt": False})
    with pytest.raises(APIError) as err:
        asyncio.run(serving.chat_prompt_ids(empty, validate=False))
    assert err.value.message == "continue_final_message: there is no message to continue"


def test_continue_final_message_and_a_generation_prompt_exclude_each_other():
    with pytest.raises(ValueError, match="continue_final_message: cannot be true together"):
        ChatCompletionRequest.model_validate({"messages": CONTINUED,
                                              "continue_final_message": True})


def test_reasoning_effort_reaches_the_template(tokenizer):
    template = "{{ reasoning_effort | default('unset') }}"
    with tokenizer_executor() as pool:
        serving = _serving(tokenizer, pool, chat_template=template)
        assert tokenizer.decode(_chat_ids(serving, reasoning_effort="low")) == "low"
        assert tokenizer.decode(_chat_ids(serving)) == "unset"


# ---- /tokenizer_info and served names ----------------------------------------------------------

def test_tokenizer_info_gives_what_a_remote_tokenizer_reads(tokenizer):
    info = _serving(tokenizer, executor=None).tokenizer_info()
    json.dumps(info)  # all of it is JSON
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (
        "<|bos|>", "<|endoftext|>", "<|pad|>")
    assert info["chat_template"] == CHAT_TEMPLATE
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert "name_or_path" not in info  # where the server keeps its files is its business
    server = _serving(tokenizer, executor=None, chat_template=SERVER_TEMPLATE)
    assert server.tokenizer_info()["chat_template"] == SERVER_TEMPLATE


def test_several_served_names_first_one_reported():
    args = EngineArgs(model="m", served_model_name=["main", "alias"])
    assert args.served_model_names() == ["main", "alias"]
    assert EngineArgs(model="m").served_model_names() == ["m"]
    assert EngineArgs(served_model_name="one").served_model_names() == ["one"]
    with pytest.raises(ValueError, match="served_model_name: names repeat"):
        EngineArgs(served_model_name=["a", "a"]).served_model_names()


def test_new_serve_flags_parse():
    from widellm.entrypoints.cli import build_parser

    args = build_parser().parse_args([
        "serve", "m", "--served-model-name", "a", "b", "--max-logprobs", "5",
        "--chat-template", "t.jinja", "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0}',
        "--enable-tokenizer-info-endpoint"])
    assert args.served_model_name == ["a", "b"] and args.model == "m"
    assert (args.max_logprobs, args.chat_template, args.generation_config) == (
        5, "t.jinja", "vllm")
    assert args.override_generation_config == '{"temperature": 0}'
    assert args.enable_tokenizer_info_endpoint is True
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_logprobs, defaults.generation_config,
            defaults.enable_tokenizer_info_endpoint) == (MAX_LOGPROBS, "auto", False)
