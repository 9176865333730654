"""Tokenizers built from GGUF metadata, checked on the default model (SmolLM2-135M-Instruct)
against ids of its Hugging Face tokenizer, and on tiny synthetic vocabularies."""

import os

import pytest
from gguf import Keys, TokenType

from widellm.engine.tokenizer import get_tokenizer, tokenizer_from_gguf_metadata
from widellm.model.default_model import DEFAULT_MODEL_NAME, default_model_path

IM_START_ID = 1
IM_END_ID = 2
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
EXPECTED_CHAT_PROMPT = (
    "<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n"
    "What is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(default_model_path())


def _chat_prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(
        CHAT_MESSAGES, tokenize=False, add_generation_prompt=True
    )


def test_encode_decode_round_trip_with_single_digit_tokens(tokenizer):
    text = "Hello, world! 12345"
    ids = tokenizer(text).input_ids
    assert ids == [19556, 28, 905, 17, 216, 33, 34, 35, 36, 37]
    assert tokenizer.convert_ids_to_tokens(ids[-5:]) == ["1", "2", "3", "4", "5"]
    assert tokenizer.decode(ids) == text


def test_no_bos_is_added(tokenizer):
    assert tokenizer("hi").input_ids == [6004]
    assert tokenizer.add_bos_token is False


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == IM_END_ID
    assert tokenizer.pad_token_id == IM_END_ID
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer("<|im_start|>").input_ids == [IM_START_ID]
    turn = "<|im_start|>user\nhi<|im_end|>"
    ids = tokenizer(turn).input_ids
    assert ids == [IM_START_ID, 4093, 198, 6004, IM_END_ID]
    assert tokenizer.decode(ids) == turn
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template(tokenizer):
    prompt = _chat_prompt(tokenizer)
    assert prompt == EXPECTED_CHAT_PROMPT
    encoded = tokenizer.apply_chat_template(
        CHAT_MESSAGES, add_generation_prompt=True, return_dict=True
    )
    ids = encoded["input_ids"]
    assert ids == tokenizer(EXPECTED_CHAT_PROMPT).input_ids
    assert ids[0] == IM_START_ID and ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 2


def test_multibyte_utf8_round_trip(tokenizer):
    text = "héllo wörld 日本語 🙂"
    ids = tokenizer(text).input_ids
    assert len(ids) == 14
    assert tokenizer.decode(ids) == text


def test_default_name_and_gguf_file_in_folder_resolve_to_the_same_tokenizer(tokenizer):
    path = default_model_path()
    by_folder = get_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path))
    by_name = get_tokenizer(DEFAULT_MODEL_NAME)
    for other in (by_folder, by_name):
        assert other(EXPECTED_CHAT_PROMPT).input_ids == tokenizer(EXPECTED_CHAT_PROMPT).input_ids
        assert other.eos_token_id == IM_END_ID


def test_hf_folder_loads_saved_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = get_tokenizer(str(tmp_path))
    assert reloaded("Hello, world! 12345").input_ids == tokenizer("Hello, world! 12345").input_ids
    assert reloaded("hi").input_ids == [6004]
    assert reloaded.eos_token == "<|im_end|>"
    assert _chat_prompt(reloaded) == EXPECTED_CHAT_PROMPT


def test_unknown_model_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not download"):
        get_tokenizer(str(tmp_path / "no-such-model"))


def _tiny_bpe_metadata(**overrides):
    """A byte-level vocabulary: control tokens 0..1, then a, b, ab, digits and 'Ġ' (space)."""
    metadata = {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.PRE: "smollm",
        Keys.Tokenizer.LIST: ["<s>", "</s>", "a", "b", "ab", "1", "2", "12", "Ġ"],
        Keys.Tokenizer.TOKEN_TYPE: [TokenType.CONTROL] * 2 + [TokenType.NORMAL] * 7,
        Keys.Tokenizer.MERGES: ["a b", "1 2"],
        Keys.Tokenizer.BOS_ID: 0,
        Keys.Tokenizer.EOS_ID: 1,
    }
    metadata.update(overrides)
    return metadata


def test_add_bos_and_eos_follow_metadata():
    plain = tokenizer_from_gguf_metadata(_tiny_bpe_metadata())
    assert plain("ab").input_ids == [4]
    both = tokenizer_from_gguf_metadata(
        _tiny_bpe_metadata(**{Keys.Tokenizer.ADD_BOS: True, Keys.Tokenizer.ADD_EOS: True})
    )
    assert both("ab").input_ids == [0, 4, 1]
    assert both.pad_token == "</s>"  # no padding id in the file: falls back to EOS


def test_digit_splitting_depends_on_pre_tokenizer():
    smollm = tokenizer_from_gguf_metadata(_tiny_bpe_metadata())
    gpt2 = tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{Keys.Tokenizer.PRE: "gpt2"}))
    assert smollm("a 12").input_ids == [2, 8, 5, 6]
    assert gpt2("a 12").input_ids == [2, 8, 7]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({Keys.Tokenizer.MODEL: "llama", Keys.Tokenizer.MERGES: None}, "'llama'.*not supported"),
        ({Keys.Tokenizer.MERGES: []}, "merges: none"),
        ({Keys.Tokenizer.PRE: "some-new-pre"}, "pre-tokenizer 'some-new-pre'"),
        ({Keys.Tokenizer.MERGES: ["ab"]}, "malformed GGUF BPE merge"),
    ],
)
def test_unsupported_gguf_tokenizers_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**overrides))
