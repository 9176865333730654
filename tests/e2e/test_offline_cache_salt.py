"""``cache_salt`` through the offline API (``LLM.generate`` prompt dicts and ``LLM.chat``):
a prompt reuses cached blocks only when it carries the same salt (or none, like the first)."""

from __future__ import annotations

import pytest

from widellm.engine.llm import LLM
from widellm.sampling_params import SamplingParams

MODEL_ARCH = "LlamaForCausalLM"
BLOCK_SIZE = 16
PROMPT_IDS = [(7 * i + 3) % 500 + 10 for i in range(40)]  # two full blocks and 8 tokens more
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "What is the capital of France? " * 4}]


def _cached_tokens(num_prompt_tokens: int) -> int:
    """Tokens a repeat of a prompt finds cached: its full blocks, less the last token, which
    is always recomputed to produce the first output's logits."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model_dir(MODEL_ARCH), dtype="float32", num_kv_blocks=64, max_model_len=512,
                 block_size=BLOCK_SIZE)
    yield engine
    engine.shutdown()


def _cached(llm: LLM, salt: str | None) -> int:
    prompt = {"prompt_token_ids": PROMPT_IDS}
    if salt is not None:
        prompt["cache_salt"] = salt
    (out,) = llm.generate(prompt, PARAMS, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    return out.num_cached_tokens


def test_generate_shares_blocks_within_a_salt_only(llm):
    full = _cached_tokens(len(PROMPT_IDS))
    assert full == 32
    # In order: each value is what that call found cached after all the calls before it.
    salts = ["a", "a", "b", None, None, "b", "a"]
    assert [_cached(llm, s) for s in salts] == [0, full, 0, 0, full, full, full]


def test_chat_cache_salt_separates_conversations(llm):
    ids = llm.get_tokenizer().apply_chat_template(MESSAGES, tokenize=True,
                                                  add_generation_prompt=True, return_dict=False)
    full = _cached_tokens(len(ids))
    assert full >= BLOCK_SIZE

    def cached(salt: str | None) -> int:
        (out,) = llm.chat(MESSAGES, PARAMS, use_tqdm=False, cache_salt=salt)
        return out.num_cached_tokens

    assert [cached(s) for s in ["chat-x", "chat-x", "chat-y", None]] == [0, full, 0, 0]


def test_two_salts_for_one_prompt_are_refused(llm):
    with pytest.raises(ValueError, match="cache_salt"):
        llm.llm_engine.processor.cache_salt({"prompt": "hi", "cache_salt": "a"}, "b")
