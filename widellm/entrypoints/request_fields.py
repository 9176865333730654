"""What the server does with every field of the OpenAI request schemas, and the check that
refuses a field it would otherwise ignore although it changes the answer.

Each field is one of: honoured (declared on our request model and acted on), rejected (a 400
naming the field whenever it is sent with a value that asks for something; the value that asks
for nothing is accepted), or accepted with no effect (it cannot change the output: billing,
storage and routing hints). ``tests/entrypoints/test_request_fields.py`` lists every field of
the ``openai`` SDK's request types and fails for one missing here, so a field OpenAI adds gets
a decision instead of silence.

vLLM's own extras that widellm does not implement are rejected the same way; other unknown
fields are still ignored, so clients sending harmless newer options keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

HONOURED = "honoured"
REJECTED = "rejected"
NO_EFFECT = "accepted, no effect"

# The content part type chat messages may carry: the served models read text only.
TEXT_PART = "text"


def _absent(value: Any, _: Mapping[str, Any]) -> bool:
    return value is None


def _absent_or(*inert: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    """A check accepting None and the listed values (each asks for nothing)."""
    return lambda value, _: value is None or value in inert


def _best_of_is_n(value: Any, data: Mapping[str, Any]) -> bool:
    # best_of = n returns every sample drawn: the same as plain n sampling.
    return value is None or value == 1 or value == data.get("n", 1)


@dataclass(frozen=True)
class FieldPolicy:
    status: str
    why: str = ""
    # For a rejected field: whether the value sent asks for nothing (then it is accepted).
    inert: Callable[[Any, Mapping[str, Any]], bool] = _absent


def honoured(why: str = "") -> FieldPolicy:
    return FieldPolicy(HONOURED, why)


def no_effect(why: str) -> FieldPolicy:
    return FieldPolicy(NO_EFFECT, why)


def rejected(why: str, inert: Callable[[Any, Mapping[str, Any]], bool] = _absent
             ) -> FieldPolicy:
    return FieldPolicy(REJECTED, why, inert)


# Fields both OpenAI endpoints share.
_SHARED_OPENAI = {
    "model": honoured(),
    "n": honoured(),
    "temperature": honoured(),
    "top_p": honoured(),
    "presence_penalty": honoured(),
    "frequency_penalty": honoured(),
    "logit_bias": honoured(),
    "seed": honoured(),
    "stop": honoured(),
    "stream": honoured(),
    "stream_options": honoured(),
    "max_tokens": honoured(),
    "logprobs": honoured(),
    "user": no_effect("an end-user id for OpenAI's abuse monitoring"),
}

COMPLETION_FIELDS: dict[str, FieldPolicy] = {
    **_SHARED_OPENAI,
    "prompt": honoured(),
    "echo": honoured(),
    "suffix": rejected("insertion (text after the completion) is not supported",
                       _absent_or("")),
    "best_of": rejected("best_of other than n is not supported (it ranks best_of samples "
                        "and returns n); leave it unset or equal to n", _best_of_is_n),
}

CHAT_FIELDS: dict[str, FieldPolicy] = {
    **_SHARED_OPENAI,
    "messages": honoured("text content parts; other part types are a 400"),
    "max_completion_tokens": honoured(),
    "top_logprobs": honoured(),
    "response_format": honoured("structured outputs"),
    "tools": honoured("tool calling"),
    "tool_choice": honoured("tool calling"),
    "parallel_tool_calls": honoured("tool calling"),
    "reasoning_effort": honoured("passed to the chat template as reasoning_effort (as vLLM "
                                 "does); templates of reasoning models read it"),
    "audio": rejected("audio output is not supported: the served models write text"),
    "modalities": rejected('only ["text"] output is supported', _absent_or(["text"])),
    "functions": rejected("the deprecated functions API is not supported; send tools",
                          _absent_or([])),
    "function_call": rejected("the deprecated functions API is not supported; send "
                              "tool_choice", _absent_or("none")),
    "web_search_options": rejected("web search is not supported"),
    "moderation": rejected("moderation is not supported"),
    "verbosity": rejected("verbosity is not supported (only OpenAI's default, medium)",
                          _absent_or("medium")),
    "prediction": no_effect("predicted outputs only speed OpenAI up; the answer is the same "
                            "without them"),
    "metadata": no_effect("tags for OpenAI's stored completions"),
    "store": no_effect("nothing is stored"),
    "service_tier": no_effect("one tier here"),
    "prompt_cache_key": no_effect("prefix caching is automatic: equal prefixes share KV "
                                  "blocks without a key (cache_salt isolates tenants)"),
    "prompt_cache_options": no_effect("prefix caching is automatic"),
    "prompt_cache_retention": no_effect("prefix caching is automatic"),
    "safety_identifier": no_effect("an end-user id for OpenAI's abuse monitoring"),
}

# vLLM's extras that widellm does not implement; each changes the output when used.
_VLLM_SHARED_UNSUPPORTED = {
    "use_beam_search": rejected("beam search is not supported", _absent_or(False)),
    "length_penalty": rejected("length_penalty (beam search) is not supported",
                               _absent_or(1, 1.0)),
    "bad_words": rejected("bad_words is not supported; use logit_bias", _absent_or([])),
    "logits_processors": rejected("custom logits processors are not supported"),
    "spaces_between_special_tokens": rejected(
        "spaces_between_special_tokens=false is not supported", _absent_or(True)),
    "mm_processor_kwargs": rejected("multimodal inputs are not supported"),
    "vllm_xargs": rejected("vllm_xargs (custom sampling arguments) is not supported"),
}

VLLM_COMPLETION_UNSUPPORTED: dict[str, FieldPolicy] = {
    **_VLLM_SHARED_UNSUPPORTED,
    "prompt_embeds": rejected("prompt embeddings are not supported"),
}

VLLM_CHAT_UNSUPPORTED: dict[str, FieldPolicy] = {
    **_VLLM_SHARED_UNSUPPORTED,
    "echo": rejected("echoing the last message is not supported", _absent_or(False)),
}


def check_fields(policies: Mapping[str, FieldPolicy], data: Any) -> None:
    """ValueError naming the first rejected field ``data`` (a raw request body) uses."""
    if not isinstance(data, Mapping):
        return  # not an object: the model's own validation says so
    for name, policy in policies.items():
        if policy.status == REJECTED and name in data and not policy.inert(data[name], data):
            raise ValueError(f"{name}: {policy.why}")


def check_content_parts(data: Any) -> None:
    """ValueError naming ``messages[i].content[j].type`` for a part that is not text."""
    messages = data.get("messages") if isinstance(data, Mapping) else None
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if isinstance(kind, str) and kind != TEXT_PART:
                raise ValueError(f"messages[{i}].content[{j}].type: {kind!r} parts are not "
                                 f"supported (the served models read text); send text parts")


def check_completion_request(data: Any) -> None:
    check_fields(COMPLETION_FIELDS, data)
    check_fields(VLLM_COMPLETION_UNSUPPORTED, data)


def check_chat_request(data: Any) -> None:
    check_fields(CHAT_FIELDS, data)
    check_fields(VLLM_CHAT_UNSUPPORTED, data)
    check_content_parts(data)
