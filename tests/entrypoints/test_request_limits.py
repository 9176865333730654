"""Limits the server applies before the expensive part of a request: the characters one token
can cover (so over-long text is refused untokenized), tokenizing off the event loop, and chat
templates sent in requests (refused unless trusted; used when trusted)."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import unicodedata
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, normalizers, pre_tokenizers

from widellm.engine.processor import InputProcessor
from widellm.engine.tokenizer import (
    MAX_CANONICAL_DECOMPOSITION, get_tokenizer, max_chars_per_token,
)
from widellm.entrypoints.errors import APIError
from widellm.entrypoints.input_checks import INT64_MAX, check_json_values
from widellm.entrypoints.protocol_chat import ChatCompletionRequest, TokenizeRequest
from widellm.entrypoints.serving_base import OpenAIServing, tokenizer_executor

MODEL_ARCH = "LlamaForCausalLM"
MAX_MODEL_LEN = 8
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
# Renders differently from the model's template ("<|user|>\nhi\n..."), so using it shows.
REQUEST_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}={{ m['content'] }}]{% endfor %}"
RENDERED = "[user=hi][assistant=yo]"


@pytest.fixture
def tokenizer(model_dir):
    return get_tokenizer(model_dir(MODEL_ARCH))


def _serving(tokenizer, executor, trust: bool = False) -> OpenAIServing:
    model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN,
                                   hf_config=SimpleNamespace(vocab_size=len(tokenizer)))
    engine = SimpleNamespace(model_config=model_config, tokenizer=tokenizer,
                             processor=InputProcessor(model_config, tokenizer, []))
    return OpenAIServing(engine, ["tiny"], 1, executor=executor,
                         trust_request_chat_template=trust)


# ---- characters per token ------------------------------------------------------------------

def test_the_bound_is_the_longest_vocabulary_string(tokenizer):
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert longest > 1
    assert max_chars_per_token(tokenizer) == longest


def test_composing_normalizers_multiply_the_bound(tokenizer):
    longest = max_chars_per_token(tokenizer)
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace("  ", "-")])
    assert max_chars_per_token(tokenizer) == longest * MAX_CANONICAL_DECOMPOSITION * 2


def test_the_longest_canonical_decomposition_is_the_constant():
    assert MAX_CANONICAL_DECOMPOSITION == max(
        len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1))


@pytest.mark.parametrize("change", ["whitespace split", "stripping", "deleting replace",
                                    "removed split", "lstrip added token"])
def test_tokenizers_that_can_drop_characters_have_no_bound(tokenizer, change):
    backend = tokenizer.backend_tokenizer
    if change == "whitespace split":
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    elif change == "stripping":
        backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    elif change == "deleting replace":
        backend.normalizer = normalizers.Replace(" ", "")
    elif change == "removed split":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(), pre_tokenizers.Split(" ", "removed")])
    else:
        tokenizer.add_tokens([AddedToken("<sep>", lstrip=True)])
    assert max_chars_per_token(tokenizer) is None


@pytest.mark.parametrize("text", ["a" * 500, "the the the " * 40, "<|endoftext|>" * 30,
                                  "héllo wörld ✓ " * 30, "".join(map(chr, range(32, 600)))])
def test_no_text_encodes_to_fewer_tokens_than_the_bound_says(tokenizer, text):
    bound = max_chars_per_token(tokenizer)
    assert len(tokenizer(text).input_ids) >= math.ceil(len(text) / bound)


def test_check_text_length_refuses_exactly_the_text_that_cannot_fit(tokenizer):
    serving = _serving(tokenizer, executor=None)
    processor = serving.engine.processor
    bound = processor.max_chars_per_token
    processor.check_text_length("a" * (bound * MAX_MODEL_LEN))
    with pytest.raises(ValueError) as e:
        processor.check_text_length("a" * (bound * MAX_MODEL_LEN + 1), "messages")
    assert str(e.value) == (
        f"messages: {bound * MAX_MODEL_LEN + 1} characters are at least {MAX_MODEL_LEN + 1} "
        f"tokens (no token of this tokenizer covers more than {bound} characters), more than "
        f"max_model_len={MAX_MODEL_LEN}")


# ---- off the event loop ------------------------------------------------------------------------

def test_prompts_are_tokenized_on_the_pool_not_the_loop(tokenizer):
    threads = []

    class Recording:
        def __call__(self, text, **kwargs):
            threads.append(threading.current_thread().name)
            return tokenizer(text, **kwargs)

    with tokenizer_executor() as pool:
        serving = _serving(tokenizer, pool)
        serving.engine.processor.tokenizer = Recording()
        result = asyncio.run(serving.tokenize_prompts(["hello", [5, 6]], "prompt"))
    assert result == [("hello", tokenizer("hello").input_ids), (None, [5, 6])]
    assert len(threads) == 1 and threads[0].startswith("widellm-tokenize")


def test_too_long_text_is_refused_before_reaching_the_pool(tokenizer):
    serving = _serving(tokenizer, executor=None)  # any use of the pool would fail
    too_long = "a" * (serving.engine.processor.max_chars_per_token * MAX_MODEL_LEN + 1)
    with pytest.raises(APIError) as e:
        asyncio.run(serving.tokenize_prompts(["ok", too_long], "prompt"))
    assert (e.value.status, e.value.param) == (400, "prompt")


# ---- request chat templates ------------------------------------------------------------------

def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, add_generation_prompt=False, **fields)


@pytest.mark.parametrize("fields", [{"chat_template": REQUEST_TEMPLATE},
                                    {"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}}])
def test_a_trusted_request_template_is_the_one_rendered(tokenizer, fields):
    expected = tokenizer(RENDERED, add_special_tokens=False).input_ids
    assert tokenizer.decode(expected) == RENDERED
    with tokenizer_executor() as pool:
        serving = _serving(tokenizer, pool, trust=True)
        ids = asyncio.run(serving.chat_prompt_ids(_chat(**fields), validate=False))
        default = asyncio.run(serving.chat_prompt_ids(_chat(), validate=False))
    assert ids == expected
    assert default == tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    assert default != expected


@pytest.mark.parametrize("request_model", [_chat, TokenizeRequest])
@pytest.mark.parametrize("fields, param", [
    ({"chat_template": REQUEST_TEMPLATE}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}}, "chat_template_kwargs"),
])
def test_an_untrusted_request_template_is_refused(tokenizer, request_model, fields, param):
    if request_model is TokenizeRequest:
        fields = {**fields, "messages": MESSAGES}
    serving = _serving(tokenizer, executor=None)
    with pytest.raises(APIError) as e:
        serving.request_chat_template(request_model(**fields))
    assert (e.value.status, e.value.param) == (400, param)
    assert "--trust-request-chat-template" in e.value.message


def test_two_different_request_templates_are_refused(tokenizer):
    serving = _serving(tokenizer, executor=None, trust=True)
    request = _chat(chat_template=REQUEST_TEMPLATE,
                    chat_template_kwargs={"chat_template": REQUEST_TEMPLATE + " "})
    with pytest.raises(APIError) as e:
        serving.request_chat_template(request)
    assert (e.value.status, e.value.param) == (400, "chat_template")


# ---- token-id lists in the body checks -------------------------------------------------------

def test_token_id_lists_are_checked_whole_and_name_the_bad_index():
    check_json_values({"prompt": [0, 1, INT64_MAX], "stop_token_ids": [True, 2]})
    with pytest.raises(ValueError) as e:
        check_json_values({"prompt": [1, 2, INT64_MAX + 1]})
    assert str(e.value) == "prompt: prompt.2 must fit in a signed 64-bit integer"
    with pytest.raises(ValueError) as e:
        check_json_values({"prompt": [[1, 2], [3, float("nan")]]})
    assert str(e.value) == "prompt: prompt.1.1 must be a finite number, got nan"


# ---- flags -------------------------------------------------------------------------------------

def test_serve_flags_parse_and_refuse_a_non_positive_limit(capsys):
    from widellm.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--max-request-body-bytes", "1024",
                              "--trust-request-chat-template"])
    assert (args.max_request_body_bytes, args.trust_request_chat_template) == (1024, True)
    assert parser.parse_args(["serve"]).trust_request_chat_template is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-request-body-bytes", "0"])
    assert "must be a positive number of bytes, got 0" in capsys.readouterr().err
