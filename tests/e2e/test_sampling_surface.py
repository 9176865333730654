"""The rest of the sampling surface against a live ``widellm serve``, driven by the official
``openai`` client: continue_final_message, echo with max_tokens 0, prompt_logprobs, several
served names, --max-logprobs, generation-config defaults, --chat-template, /tokenizer_info,
return_token_ids (checked against transformers' own greedy ids), and a 400 for a field that
would otherwise be ignored.

One server for the module, started with every flag under test: its generation config (a
folder given to --generation-config) makes greedy decoding of 6 tokens the default."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import hf_greedy
from tests.e2e.server_harness import ServerProcess

MODEL_ARCH = "LlamaForCausalLM"
NAMES = ["tiny-main", "tiny-alias"]
MAX_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 6  # the generation config's max_new_tokens
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": DEFAULT_MAX_TOKENS}
# Not the model's template ("<|user|>\n..."): answers rendered with it show the flag works.
SERVER_TEMPLATE = ("{% for d in documents or [] %}[doc {{ d['title'] }}] {{ d['text'] }}\n"
                   "{% endfor %}"
                   "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
PROMPT = "The capital of France is"
CONTINUED = [{"role": "user", "content": "Tell me"},
             {"role": "assistant", "content": "The answer is"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}  # fixed output lengths from a random model
NUM_TOKENS = 8
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("surface")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    template = folder / "template.jinja"
    template.write_text(SERVER_TEMPLATE)
    proc = ServerProcess(model_dir(MODEL_ARCH), folder / "server.log", [
        "--served-model-name", *NAMES, "--max-logprobs", str(MAX_LOGPROBS),
        "--generation-config", str(folder), "--chat-template", str(template),
        "--enable-tokenizer-info-endpoint"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                       timeout=REQUEST_TIMEOUT_S, max_retries=0) as c:
        yield c


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_continue_final_message_continues_the_assistant_text(server, client):
    chat = client.chat.completions.create(
        model=NAMES[0], messages=CONTINUED, max_tokens=NUM_TOKENS, logprobs=True,
        extra_body={**CONTINUE, **IGNORE_EOS, **GREEDY})
    # The prompt it ran: the assistant's message left open, in the server's template.
    ids = _post(server, "/tokenize", {"messages": CONTINUED, **CONTINUE})["tokens"]
    rendered = _post(server, "/detokenize", {"tokens": ids})["prompt"]
    assert rendered == "[user] Tell me\n[assistant] The answer is"
    # The same prompt as token ids on /v1/completions gives the same greedy tokens.
    completion = client.completions.create(
        model=NAMES[0], prompt=ids, max_tokens=NUM_TOKENS, logprobs=0,
        extra_body={**IGNORE_EOS, **GREEDY})
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens == len(ids)
    assert chat.usage.completion_tokens == completion.usage.completion_tokens == NUM_TOKENS
    assert [t.token for t in chat.choices[0].logprobs.content] == \
        completion.choices[0].logprobs.tokens
    assert chat.choices[0].message.content == completion.choices[0].text


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client):
    only = client.completions.create(model=NAMES[0], prompt=PROMPT, echo=True, max_tokens=0,
                                      logprobs=2)
    one = client.completions.create(model=NAMES[0], prompt=PROMPT, echo=True, max_tokens=1,
                                     logprobs=2)
    choice = only.choices[0]
    n = only.usage.prompt_tokens
    assert (choice.text, choice.finish_reason) == (PROMPT, "length")
    assert (only.usage.completion_tokens, only.usage.total_tokens) == (0, n)
    assert "".join(choice.logprobs.tokens) == PROMPT and len(choice.logprobs.tokens) == n
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    # The prompt part of echo + 1 token is the same, to the bit.
    head = one.choices[0].logprobs
    assert len(head.tokens) == n + 1 and one.usage.completion_tokens == 1
    assert head.tokens[:n] == choice.logprobs.tokens
    assert head.token_logprobs[:n] == choice.logprobs.token_logprobs
    assert head.top_logprobs[:n] == choice.logprobs.top_logprobs
    assert head.text_offset[:n] == choice.logprobs.text_offset
    # Without echo, 0 tokens is nothing to return.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_prompt_logprobs_on_chat_and_completions(server, client):
    chat = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
        extra_body={"prompt_logprobs": 2})
    ids = _post(server, "/tokenize", {"messages": [{"role": "user", "content": PROMPT}]})[
        "tokens"]
    listed = chat.model_extra["prompt_logprobs"]
    assert len(listed) == len(ids) == chat.usage.prompt_tokens and listed[0] is None
    for token_id, position in zip(ids[1:], listed[1:]):
        # The prompt's token and the top 2 (two entries when the token is one of them).
        ranks = {entry["rank"] for entry in position.values()}
        assert str(token_id) in position and {1, 2} <= ranks and len(position) == len(ranks)
        assert len(position) == (2 if position[str(token_id)]["rank"] <= 2 else 3)
    # The same prompt as token ids on /v1/completions: the same entries, per choice.
    completion = _post(server, "/v1/completions", {
        "model": NAMES[0], "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    assert completion["choices"][0]["prompt_logprobs"] == listed


def _stream_ids(stream) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per choice index: the prompt ids of its first chunk (only that one may carry them, the
    response-level field in chat), and its generated ids, joined over its chunks."""
    prompts: dict[int, list[int]] = {}
    generated: dict[int, list[int]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            prompt = getattr(choice, "prompt_token_ids", None) or chunk.model_extra.get(
                "prompt_token_ids")
            if choice.index in generated:
                assert prompt is None, "prompt ids on a later chunk"
            else:
                prompts[choice.index] = prompt
            generated.setdefault(choice.index, []).extend(choice.token_ids or [])
    return prompts, generated


def test_return_token_ids_gives_the_prompt_and_the_greedy_ids(server, client, model_dir):
    """Both endpoints, plain and streamed, n = 2: the prompt's ids as /tokenize has them and
    each choice's generated ids, equal to transformers' greedy continuation of that prompt."""
    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = _post(server, "/tokenize", {"messages": messages})["tokens"]
    text_ids = _post(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    want_chat, want_text = hf_greedy(model_dir(MODEL_ARCH), [chat_ids, text_ids], NUM_TOKENS)
    args = dict(model=NAMES[0], max_tokens=NUM_TOKENS, n=2,
                extra_body={"return_token_ids": True, **IGNORE_EOS, **GREEDY})

    chat = client.chat.completions.create(messages=messages, **args)
    assert chat.model_extra["prompt_token_ids"] == chat_ids
    assert [c.token_ids for c in chat.choices] == [want_chat] * 2
    completion = client.completions.create(prompt=PROMPT, **args)
    assert [c.prompt_token_ids for c in completion.choices] == [text_ids] * 2
    assert [c.token_ids for c in completion.choices] == [want_text] * 2

    prompts, generated = _stream_ids(client.chat.completions.create(
        messages=messages, stream=True, **args))
    assert (prompts, generated) == ({0: chat_ids, 1: chat_ids}, {0: want_chat, 1: want_chat})
    prompts, generated = _stream_ids(client.completions.create(
        prompt=PROMPT, stream=True, **args))
    assert (prompts, generated) == ({0: text_ids, 1: text_ids}, {0: want_text, 1: want_text})


def test_return_token_ids_with_a_forced_tool_call_streams_every_id(client):
    """A tool-call stream holds text back while it parses (this random model's call runs to
    max_tokens); the ids of every chunk still go out: joined, the plain request's ids."""
    tool = {"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {
            "q": {"type": "string", "maxLength": 3}}, "required": ["q"]}}}
    args = dict(model=NAMES[0], messages=[{"role": "user", "content": PROMPT}],
                tools=[tool], tool_choice="required", max_tokens=64,
                extra_body={"return_token_ids": True, **GREEDY})
    whole = client.chat.completions.create(**args).choices[0]
    assert len(whole.token_ids) == 64
    _, generated = _stream_ids(client.chat.completions.create(stream=True, **args))
    assert generated == {0: whole.token_ids}


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client):
    """Every logprobs token (chosen and top-N) named "token_id:{id}", the chosen ones the
    choice's own ids; text offsets and bytes stay those of the text (the same request
    without the field: same greedy tokens)."""
    ids = {"return_token_ids": True, **IGNORE_EOS, **GREEDY}
    args = dict(model=NAMES[0], max_tokens=NUM_TOKENS)
    named = client.completions.create(prompt=PROMPT, logprobs=2, **args, extra_body={
        **ids, "return_tokens_as_token_ids": True}).choices[0]
    plain = client.completions.create(prompt=PROMPT, logprobs=2, **args,
                                      extra_body=ids).choices[0]
    assert named.token_ids == plain.token_ids and named.text == plain.text
    assert named.logprobs.tokens == [f"token_id:{t}" for t in named.token_ids]
    assert named.logprobs.text_offset == plain.logprobs.text_offset
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    for top in named.logprobs.top_logprobs:
        assert len(top) == 2 and all(k.startswith("token_id:") for k in top)
    messages = [{"role": "user", "content": PROMPT}]
    named = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                           **args, extra_body={
                                               **ids, "return_tokens_as_token_ids": True})
    plain = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                           **args, extra_body=ids)
    named, plain = named.choices[0], plain.choices[0]
    assert [e.token for e in named.logprobs.content] == [
        f"token_id:{t}" for t in named.token_ids]
    assert [e.bytes for e in named.logprobs.content] == [
        e.bytes for e in plain.logprobs.content]
    for entry in named.logprobs.content:
        assert [t.token.startswith("token_id:") for t in entry.top_logprobs] == [True, True]


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client, model_dir):
    """Completions (text and ids) and chat run only the prompt's last k tokens; a text or an
    id list longer than the context is then accepted, not refused; k = -1 keeps
    max_model_len; 0 or more than max_model_len is a 400 naming the field."""
    from transformers import AutoTokenizer

    from tests.e2e.server_harness import MAX_MODEL_LEN

    def run(**kwargs) -> list[int]:
        extra = {"return_token_ids": True, **kwargs.pop("extra", {})}
        return client.completions.create(model=NAMES[0], max_tokens=1, **kwargs,
                                         extra_body=extra).choices[0].prompt_token_ids

    long_text = " ".join(["the river is blue and the sky is green"] * 400)
    with pytest.raises(openai.BadRequestError):  # without truncation: too long to run
        run(prompt=long_text)
    want = AutoTokenizer.from_pretrained(model_dir(MODEL_ARCH))(long_text).input_ids
    assert len(want) > MAX_MODEL_LEN
    assert run(prompt=long_text, extra={"truncate_prompt_tokens": 100}) == want[-100:]
    assert run(prompt=want, extra={"truncate_prompt_tokens": 100}) == want[-100:]
    assert run(prompt=want[:50], extra={"truncate_prompt_tokens": 100}) == want[:50]
    # -1 keeps a whole context: no room left to generate even one token.
    with pytest.raises(openai.BadRequestError) as err:
        run(prompt=want, extra={"truncate_prompt_tokens": -1})
    assert f"the prompt ({MAX_MODEL_LEN} tokens) plus max_tokens (1)" in str(err.value)
    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = _post(server, "/tokenize", {"messages": messages})["tokens"]
    chat = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 3,
                                                      "return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == chat_ids[-3:]
    assert chat.usage.prompt_tokens == 3
    for keep in (0, -2, MAX_MODEL_LEN + 1):
        with pytest.raises(openai.BadRequestError) as err:
            run(prompt=PROMPT, extra={"truncate_prompt_tokens": keep})
        assert err.value.body["param"] == "truncate_prompt_tokens", keep


def test_allowed_token_ids_limit_every_sampled_token(server, client):
    """Greedy and random choices alike sample only the allowed ids (read back with
    return_token_ids); an id outside the vocabulary or an empty list is a 400 naming it."""
    allowed = _post(server, "/tokenize", {"prompt": " river sky"})["tokens"][:2]
    for extra in (GREEDY, {"temperature": 1.0, "seed": 7}):
        out = client.completions.create(model=NAMES[0], prompt=PROMPT, n=3, max_tokens=12,
                                        extra_body={"allowed_token_ids": allowed,
                                                    "return_token_ids": True, **IGNORE_EOS,
                                                    **extra})
        sampled = {t for choice in out.choices for t in choice.token_ids}
        assert sampled <= set(allowed) and sum(len(c.token_ids) for c in out.choices) == 36
    chat = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
        extra_body={"allowed_token_ids": allowed[:1], "return_token_ids": True, **IGNORE_EOS})
    assert chat.choices[0].token_ids == allowed[:1] * 12
    for bad in ([10 ** 9], []):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=NAMES[0], prompt=PROMPT,
                                      extra_body={"allowed_token_ids": bad})
        assert err.value.body["param"] == "allowed_token_ids", bad


def test_documents_reach_the_chat_template(server, client):
    """vLLM's documents: rendered by a template that reads them (this server's), the same on
    /tokenize and in the chat request that runs them."""
    documents = [{"title": "Paris", "text": "Paris is the capital of France."}]
    messages = [{"role": "user", "content": "What is the capital?"}]
    ids = _post(server, "/tokenize", {"messages": messages, "documents": documents})["tokens"]
    rendered = _post(server, "/detokenize", {"tokens": ids})["prompt"]
    assert rendered == ("[doc Paris] Paris is the capital of France.\n"
                        "[user] What is the capital?\n[assistant] ")
    chat = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1,
                                          extra_body={"documents": documents,
                                                      "return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == ids


def test_without_return_token_ids_no_ids_are_sent(server):
    chat = _post(server, "/v1/chat/completions", {
        "model": NAMES[0], "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2})
    completion = _post(server, "/v1/completions",
                       {"model": NAMES[0], "prompt": PROMPT, "max_tokens": 2})
    assert chat.get("prompt_token_ids") is None and chat["choices"][0].get("token_ids") is None
    choice = completion["choices"][0]
    assert choice.get("prompt_token_ids") is None and choice.get("token_ids") is None


def test_prompt_logprobs_survive_a_first_output_held_back_by_a_stop_string(server):
    """A long stop string holds the first tokens' text back (it might be the stop string's
    start), so the choice's first delta has no text: it still carries the prompt's logprobs
    and ids."""
    body = {"model": NAMES[0], "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 1,
            "return_token_ids": True, "stop": ["x" * 200], **IGNORE_EOS}
    choice = _post(server, "/v1/completions", body)["choices"][0]
    ids = _post(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 3
    assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None


def test_every_served_name_answers_and_the_first_is_listed_first(client):
    assert [m.id for m in client.models.list().data] == NAMES
    for name in NAMES:
        response = client.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert response.model == name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=1)


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("completions", {"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("chat", {"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
])
def test_max_logprobs_caps_every_logprobs_field(server, endpoint, fields, param):
    body = ({"prompt": PROMPT} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": PROMPT}]})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(server.url + path, json={**body, **fields, "max_tokens": 1},
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    at_cap = {k: (MAX_LOGPROBS if v == MAX_LOGPROBS + 1 else v) for k, v in fields.items()}
    _post(server, path, {**body, **at_cap, "max_tokens": 1})


def test_generation_config_defaults_apply_when_the_request_leaves_them_unset(server, client):
    default = client.completions.create(model=NAMES[0], prompt=PROMPT,
                                        extra_body=IGNORE_EOS)
    explicit = client.completions.create(model=NAMES[0], prompt=PROMPT,
                                         max_tokens=DEFAULT_MAX_TOKENS,
                                         extra_body={**IGNORE_EOS, **GREEDY})
    sampled = client.completions.create(model=NAMES[0], prompt=PROMPT, temperature=1.0,
                                        seed=1, extra_body=IGNORE_EOS)
    assert default.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert default.choices[0].text == explicit.choices[0].text  # greedy by default
    assert sampled.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert sampled.choices[0].text != explicit.choices[0].text  # the request's value wins
    assert "default sampling parameters" in server.log()


def test_tokenizer_info_serves_a_remote_tokenizer(server):
    r = httpx.get(server.url + "/tokenizer_info", timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200
    info = r.json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (
        "<|endoftext|>", "<|bos|>", "<|pad|>")
    assert info["chat_template"] == SERVER_TEMPLATE
    # What lm-eval's remote tokenizer then sends: /tokenize without special tokens, and back.
    tokens = _post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False})[
        "tokens"]
    assert _post(server, "/detokenize", {"tokens": tokens})["prompt"] == "test"
    eos = _post(server, "/tokenize", {"prompt": info["eos_token"],
                                      "add_special_tokens": False})["tokens"]
    assert len(eos) == 1


def test_a_field_that_would_be_ignored_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=1, suffix="!")
    assert err.value.body["param"] == "suffix"
    image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAMES[0], max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "see"}, image]}])
    assert err.value.body["param"] == "messages[0].content[1].type"
