"""Tokenizers for the models widellm serves: a local HF checkpoint folder, or a GGUF file.

A GGUF file carries its whole tokenizer in metadata (token list, BPE merges, token types,
special ids, chat template). We build a ``tokenizers`` fast tokenizer from exactly that rather
than using transformers' GGUF conversion, which for some files adds a BOS the model never saw
and picks the wrong EOS, turning chat output into garbage.

Nothing here downloads: model names must be local paths (or the default model's name).
"""

import json
import os
from collections.abc import Mapping
from typing import Any

from gguf import Keys, TokenType
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from widellm.model.default_model import DEFAULT_MODEL_NAME, default_model_path
from widellm.model.gguf_loader import read_gguf_metadata

GGUF_SUFFIX = ".gguf"
# tokenizer.ggml.model value for byte-level BPE; llama.cpp names it after GPT-2.
_BYTE_LEVEL_BPE_MODEL = "gpt2"
# tokenizer.ggml.pre values whose splitting is GPT-2's byte-level regex, optionally after
# splitting every digit into its own piece.
_GPT2_PRE_TOKENIZERS = frozenset({"gpt2", "default"})
_DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm"})


def get_tokenizer(
    model: str, *, gguf_file: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Return the tokenizer for ``model``.

    Args:
        model: a local HF checkpoint folder, a ``.gguf`` file, or ``DEFAULT_MODEL_NAME``.
        gguf_file: a GGUF file to read the tokenizer from; relative paths are looked up
            inside ``model`` first.
        trust_remote_code: passed to ``AutoTokenizer`` for HF folders.
    Raises:
        FileNotFoundError: when ``model`` is none of the above.
        ValueError: when a GGUF file's tokenizer kind is not supported.
    """
    gguf_path = _resolve_gguf_path(model, gguf_file)
    if gguf_path is not None:
        return tokenizer_from_gguf(gguf_path)
    if os.path.isdir(model):
        return AutoTokenizer.from_pretrained(
            model, trust_remote_code=trust_remote_code, local_files_only=True
        )
    raise FileNotFoundError(
        f"'{model}' is neither a local model folder nor a {GGUF_SUFFIX} file "
        "(widellm does not download models)"
    )


def _resolve_gguf_path(model: str, gguf_file: str | None) -> str | None:
    if gguf_file is not None:
        in_model_dir = os.path.join(model, gguf_file)
        return in_model_dir if os.path.isfile(in_model_dir) else gguf_file
    if model.endswith(GGUF_SUFFIX) and os.path.isfile(model):
        return model
    if model == DEFAULT_MODEL_NAME and not os.path.exists(model):
        return default_model_path()
    return None


def tokenizer_from_gguf(path: str) -> PreTrainedTokenizerFast:
    """Build the tokenizer stored in a GGUF file's metadata."""
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path))


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """Build a byte-level BPE tokenizer from GGUF tokenizer metadata.

    Special tokens are the CONTROL-typed tokens (each encodes to one id and is skipped by
    ``decode(..., skip_special_tokens=True)``); BOS/EOS are added only where the file's
    ``add_bos_token``/``add_eos_token`` say so.

    Raises:
        ValueError: for tokenizer kinds other than byte-level BPE (e.g. SentencePiece llama
            files, which have no merges) or an unknown pre-tokenizer.
    """
    model_kind = metadata.get(Keys.Tokenizer.MODEL)
    merges = metadata.get(Keys.Tokenizer.MERGES)
    if model_kind != _BYTE_LEVEL_BPE_MODEL or not merges:
        raise ValueError(
            f"GGUF tokenizer model {model_kind!r} (merges: {'yes' if merges else 'none'}) is not "
            f"supported; only byte-level BPE ('{_BYTE_LEVEL_BPE_MODEL}' with merges) is. "
            "Use the model's Hugging Face folder for its tokenizer instead."
        )
    tokens: list[str] = list(metadata[Keys.Tokenizer.LIST])
    default_types = [TokenType.NORMAL] * len(tokens)
    token_types: list[int] = list(metadata.get(Keys.Tokenizer.TOKEN_TYPE, default_types))

    backend = Tokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=[_split_merge(merge) for merge in merges],
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    add_prefix_space = bool(metadata.get(Keys.Tokenizer.ADD_PREFIX, False))
    pre = metadata.get(Keys.Tokenizer.PRE, "default")
    backend.pre_tokenizer = _pre_tokenizer(pre, add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match before BPE splits them into pieces; user-
    # defined tokens match whole too but decode like text.
    typed = list(zip(tokens, token_types))
    backend.add_special_tokens(
        [_whole_token(tok, special=True) for tok, kind in typed if kind == TokenType.CONTROL]
    )
    backend.add_tokens(
        [_whole_token(tok, special=False) for tok, kind in typed if kind == TokenType.USER_DEFINED]
    )

    def token_at(key: str) -> str | None:
        token_id = metadata.get(key)
        return None if token_id is None else tokens[int(token_id)]

    eos_token = token_at(Keys.Tokenizer.EOS_ID)
    pad_token = token_at(Keys.Tokenizer.PAD_ID) or eos_token
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token_at(Keys.Tokenizer.BOS_ID),
        eos_token=eos_token,
        unk_token=token_at(Keys.Tokenizer.UNK_ID),
        pad_token=pad_token,
        # Passed explicitly so transformers builds the post-processor from these, never from
        # its own defaults.
        add_bos_token=bool(metadata.get(Keys.Tokenizer.ADD_BOS, False)),
        add_eos_token=bool(metadata.get(Keys.Tokenizer.ADD_EOS, False)),
        chat_template=metadata.get(Keys.Tokenizer.CHAT_TEMPLATE),
        # Byte-level BPE decodes exactly; "cleaning" would delete spaces before punctuation.
        clean_up_tokenization_spaces=False,
        add_prefix_space=add_prefix_space,
    )


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # Some files repeat a string (e.g. padding entries); the first id is the one BPE emits.
        vocab.setdefault(token, token_id)
    return vocab


def _split_merge(merge: str) -> tuple[str, str]:
    # Byte-level tokens never contain a literal space (it is mapped to 'Ġ'), so the one space
    # is the separator.
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ValueError(f"malformed GGUF BPE merge {merge!r}")
    return left, right


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _GPT2_PRE_TOKENIZERS:
        return byte_level
    if pre in _DIGIT_SPLIT_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    supported = sorted(_GPT2_PRE_TOKENIZERS | _DIGIT_SPLIT_PRE_TOKENIZERS)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {supported})")


def _whole_token(content: str, *, special: bool) -> AddedToken:
    return AddedToken(
        content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False
    )


# ---- how many characters one token can cover -------------------------------------------------

# The longest canonical decomposition of one Unicode code point (U+1F82 and kin: a letter and
# three marks). NFC/NFKC compose only sequences that decompose to one code point, so one
# normalized character stands for at most this many characters of the input.
MAX_CANONICAL_DECOMPOSITION = 4
# Normalizers whose output is never shorter than their input (decomposition and lowercasing
# only expand; ByteLevel maps each byte to one character; Prepend adds).
_LENGTHENING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "Append",
                                      "ByteLevel"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
# Pre-tokenizers that split without dropping characters ("Removed" behaviour excepted below).
# Whitespace, WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit drop what they split on.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split",
                                     "UnicodeScripts"})
_REMOVED = "Removed"


def _normalizer_shrink(spec: dict | None) -> int | None:
    """Input characters per normalized character at most; None when unbounded or unknown
    (Strip, StripAccents, BertNormalizer, Precompiled and Nmt may delete characters)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for child in spec.get("normalizers", []):
            child_factor = _normalizer_shrink(child)
            if child_factor is None:
                return None
            factor *= child_factor
        return factor
    if kind in _LENGTHENING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_CANONICAL_DECOMPOSITION
    if kind == "Replace":
        pattern = spec.get("pattern", {}).get("String")
        content = spec.get("content", "")
        if pattern is None or not content:  # a regex, or a deletion
            return None
        return max(1, -(-len(pattern) // len(content)))
    return None


def _keeps_every_character(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(child) for child in spec.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != _REMOVED


def _component_spec(component: Any) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of a prompt one token can stand for, or None where no bound holds.

    A vocabulary string of n characters matches at most n characters of normalized text (for
    byte-level BPE each character is one byte, and a character is at least one byte), so
    ``len(text) / bound`` tokens is a lower bound on what ``text`` encodes to. No bound holds
    for tokenizers that can drop characters (BERT-style whitespace splitting, stripping
    normalizers), fuse runs of unknown characters into one token, map a whole word to one
    unknown token (WordPiece, WordLevel, Unigram), or let an added token swallow whitespace."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    if backend.model.unk_token is not None and backend.model.fuse_unk:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    shrink = _normalizer_shrink(_component_spec(backend.normalizer))
    if shrink is None or not _keeps_every_character(_component_spec(backend.pre_tokenizer)):
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    return max(1, longest) * shrink
