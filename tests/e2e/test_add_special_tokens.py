"""vLLM's ``add_special_tokens`` on both endpoints of a live ``widellm serve``: completions
encode a text prompt with the tokenizer's special tokens by default and without them when it
is false (text that has its own); chat encodes the template's output as it is by default and
with the tokenizer's on top when it is true. The prompts run are read back with
``return_token_ids``.

The tiny preset's tokenizer adds nothing, so the server here gets a copy of the model whose
tokenizer prepends its BOS, as Llama's do."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from tests.e2e.server_harness import ServerProcess

MODEL_ARCH = "LlamaForCausalLM"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": PROMPT}]
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(model_dir(MODEL_ARCH), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.save_pretrained(folder)
    proc = ServerProcess(str(folder), folder.parent / "server.log", [])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _tokenize(server, body: dict) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_add_special_tokens_on_both_endpoints(server):
    with_bos = _tokenize(server, {"prompt": PROMPT})
    bare = _tokenize(server, {"prompt": PROMPT, "add_special_tokens": False})
    chat_ids = _tokenize(server, {"messages": MESSAGES})
    bos = with_bos[:1]
    assert with_bos == bos + bare and bos != chat_ids[:1]  # the test can tell them apart
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                       timeout=REQUEST_TIMEOUT_S, max_retries=0) as client:
        model = client.models.list().data[0].id
        ran = [client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={
            "return_token_ids": True, **special}).choices[0].prompt_token_ids
            for special in ({}, {"add_special_tokens": True}, {"add_special_tokens": False})]
        assert ran == [with_bos, with_bos, bare]
        ran = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                              extra_body={"return_token_ids": True, **special}
                                              ).model_extra["prompt_token_ids"]
               for special in ({}, {"add_special_tokens": False}, {"add_special_tokens": True})]
    assert ran == [chat_ids, chat_ids, bos + chat_ids]
