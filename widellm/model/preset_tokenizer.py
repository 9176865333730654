"""The tokenizer every preset ships: a deterministic byte-level BPE with exactly the model's
vocabulary size, bos/eos/pad specials at ids 0-2 and a minimal chat template (see
:func:`build_tokenizer`)."""

from __future__ import annotations

import json
from typing import Any

BOS_TOKEN = "<|bos|>"
# GPT-2's end-of-text name: transformers forces Qwen2Tokenizer onto qwen2 checkpoints, and that
# class adds "<|endoftext|>" as its unknown token unless the vocabulary already has it.
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BOS_ID, EOS_ID, PAD_ID = range(len(SPECIAL_TOKENS))
SPECIAL_TOKEN_IDS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
FILLER_TOKEN = "<filler{}>"
BYTE_ALPHABET_SIZE = 256
TOKENIZER_CONFIG_OVERRIDES = {"tokenizer_class": "PreTrainedTokenizerFast"}

# A minimal role-tagged chat template so chat endpoints work with preset tokenizers.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Original text the tokenizer's merges are learned from; it only has to be fixed and varied
# enough to give a few hundred merges, so tokenizer output looks like real subword text.
TOKENIZER_CORPUS = """\
The engine keeps a pool of fixed-size blocks for the key and value cache. Every request owns
a list of blocks, and a block that holds a full chunk of tokens gets a hash chained to the hash
of the block before it, so two prompts that start the same way can share their first blocks.
When memory runs short the scheduler preempts the request it admitted last and computes it
again later. Sparse mixture-of-experts models route each token to a few experts out of many;
the router scores every expert, picks the best groups, then the best experts inside them, and
scales the chosen weights. Wide expert parallelism spreads the experts over many ranks while
attention stays data parallel, and tokens travel to their experts and back in every layer.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512 and 1024 appear
often in configuration files, and so do words like hidden, size, layers, heads, rank, rope,
vocabulary, position, embedding, normalisation, activation and intermediate.
Quick brown foxes jump over lazy dogs; a wizard's job is to vex chumps quickly in fog.
Questions? Answers! Lists: apples, pears, plums; paths like /tmp/cache/model.safetensors;
code like def forward(self, x): return self.proj(x) * 2 + 1; JSON like {"key": [1, 2]}.
"""


def build_tokenizer(vocab_size: int, model_max_length: int | None = None) -> Any:
    """A deterministic byte-level BPE tokenizer with exactly ``vocab_size`` tokens.

    Ids 0..2 are the bos/eos/pad specials, then the 256 byte tokens, then merges learned from
    :data:`TOKENIZER_CORPUS`; if the corpus runs out of merges the rest of the vocabulary is
    filled with ``<fillerN>`` tokens that encoding never produces but decoding renders, so
    every id a random model samples decodes to text.

    Args:
        vocab_size: exact number of ids.
        model_max_length: longest sequence the model takes, recorded in the tokenizer.

    Returns:
        A ``transformers`` fast tokenizer ready for ``save_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS.splitlines(), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    filler = 0
    while len(vocab) < vocab_size:
        vocab[FILLER_TOKEN.format(filler)] = len(vocab)
        filler += 1
    tok = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    )
