"""Read GGUF checkpoints (llama.cpp's single-file format) as a Hugging Face config plus
Hugging Face-named float32 tensors, so GGUF models load through the same code as HF ones.

Three things differ between a GGUF file and the HF checkpoint it was converted from:

- names: ``blk.3.attn_q.weight`` instead of ``model.layers.3.self_attn.q_proj.weight``;
- layout: GGUF lists dimensions fastest-first, so a torch ``(out, in)`` weight is stored with
  shape ``[in, out]``, and the data may be block-quantized (Q4_1, Q8_0, ...);
- rotary layout: llama.cpp rotates adjacent pairs ``(x0, x1), (x2, x3), ...`` while HF Llama
  rotates halves ``(x_i, x_{i + d/2})``; the converter reorders the rows of Q and K within
  each head to match, and we reorder them back (see ``unpermute_rotary_rows``).

Only the ``llama`` architecture is mapped so far; others raise ``ValueError``.
"""

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from gguf import Keys
from gguf.quants import dequantize
from transformers import LlamaConfig, PretrainedConfig

from widellm.model.gguf_header import GgufTensor, read_header

# llama.cpp's default when a llama GGUF omits rope.freq_base; it is also Llama's original base.
LLAMA_DEFAULT_ROPE_THETA = 10000.0
# A value of the scaling-type key that means "no scaling".
_NO_ROPE_SCALING = "none"

_BLOCK_TENSOR_RE = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<stem>[a-z_]+)\.(?P<kind>weight|bias)$")

# GGUF tensor stems inside ``blk.{i}`` -> HF module path inside ``model.layers.{i}``.
_LLAMA_BLOCK_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors outside the blocks, by full name.
_LLAMA_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OUTPUT_WEIGHT = "output.weight"
# Present in Llama 3.1-style files: per-frequency rope factors that LlamaConfig would need as
# "llama3" rope parameters, which GGUF metadata does not carry.
_ROPE_FREQS_WEIGHT = "rope_freqs.weight"


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Return every metadata key of a GGUF file as plain Python values (str, int, float,
    bool, or lists of them), e.g. ``{"general.architecture": "llama", ...}``."""
    return read_header(path).metadata


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K projection rows.

    Within each head of ``head_dim`` rows, the converter moved row ``j`` of the first half to
    position ``2j`` and row ``j`` of the second half to ``2j + 1``, so that rotating adjacent
    pairs equals HF's rotate-half. This puts them back.

    Args:
        weight: ``(num_heads * head_dim, ...)``, a weight ``(out, in)`` or a bias ``(out,)``.
        num_heads: query heads for Q, key/value heads for K.
    Returns:
        Same shape as ``weight``, rows in HF order.
    """
    rows, *rest = weight.shape
    head_dim = rows // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()


def config_from_gguf_metadata(
    metadata: Mapping[str, Any], tensor_names: Sequence[str]
) -> PretrainedConfig:
    """Build the HF config that matches a GGUF file.

    Args:
        metadata: from ``read_gguf_metadata``.
        tensor_names: GGUF names of the file's tensors; they decide weight tying.
    Raises:
        ValueError: for an architecture or rope variant not mapped here.
    """
    arch = metadata.get(Keys.General.ARCHITECTURE)
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: 'llama')")
    if _ROPE_FREQS_WEIGHT in tensor_names:
        raise ValueError(
            f"GGUF file has '{_ROPE_FREQS_WEIGHT}' (Llama 3.1-style rope scaling), which is not "
            "supported; load the Hugging Face checkpoint instead"
        )

    def key(template: str) -> str:
        return template.format(arch=arch)

    def required(template: str) -> Any:
        name = key(template)
        if name not in metadata:
            raise ValueError(f"GGUF metadata lacks required key '{name}'")
        return metadata[name]

    hidden_size = int(required(Keys.LLM.EMBEDDING_LENGTH))
    num_heads = int(required(Keys.Attention.HEAD_COUNT))
    head_dim = int(metadata.get(key(Keys.Attention.KEY_LENGTH), hidden_size // num_heads))
    rope_dim = int(metadata.get(key(Keys.Rope.DIMENSION_COUNT), head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"partial rotary (rope dim {rope_dim} < head dim {head_dim}) is unsupported"
        )

    vocab_size = metadata.get(key(Keys.LLM.VOCAB_SIZE))
    if vocab_size is None:
        # Older converters omit it; the token list has one entry per embedding row.
        vocab_size = len(required(Keys.Tokenizer.LIST))

    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(required(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=int(required(Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=num_heads,
        num_key_value_heads=int(metadata.get(key(Keys.Attention.HEAD_COUNT_KV), num_heads)),
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(required(Keys.LLM.CONTEXT_LENGTH)),
        rms_norm_eps=float(required(Keys.Attention.LAYERNORM_RMS_EPS)),
        rope_parameters=_rope_parameters(metadata, arch),
        tie_word_embeddings=_OUTPUT_WEIGHT not in tensor_names,
        bos_token_id=metadata.get(Keys.Tokenizer.BOS_ID),
        eos_token_id=metadata.get(Keys.Tokenizer.EOS_ID),
        pad_token_id=metadata.get(Keys.Tokenizer.PAD_ID),
        # Weights come out of dequantization as float32.
        dtype=torch.float32,
    )


def _rope_parameters(metadata: Mapping[str, Any], arch: str) -> dict[str, Any]:
    theta = float(metadata.get(Keys.Rope.FREQ_BASE.format(arch=arch), LLAMA_DEFAULT_ROPE_THETA))
    scaling = metadata.get(Keys.Rope.SCALING_TYPE.format(arch=arch), _NO_ROPE_SCALING)
    if scaling == _NO_ROPE_SCALING:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        factor = float(metadata[Keys.Rope.SCALING_FACTOR.format(arch=arch)])
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported")


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file. Tensors are memory-mapped and dequantized one at a time."""

    path: str
    tensors: list[GgufTensor] = field(repr=False)
    metadata: dict[str, Any] = field(repr=False)
    config: PretrainedConfig

    @cached_property
    def generation_eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: EOS, then end-of-turn/end-of-message if declared."""
        ids: list[int] = []
        for name in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
            token_id = self.metadata.get(name)
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
        return tuple(ids)

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get(Keys.Tokenizer.CHAT_TEMPLATE)

    def hf_name(self, gguf_name: str) -> str:
        """Map a GGUF tensor name to its HF name, e.g. ``blk.0.attn_q.weight`` ->
        ``model.layers.0.self_attn.q_proj.weight``."""
        if gguf_name in _LLAMA_GLOBAL_NAMES:
            return _LLAMA_GLOBAL_NAMES[gguf_name]
        match = _BLOCK_TENSOR_RE.match(gguf_name)
        if match is None or match["stem"] not in _LLAMA_BLOCK_NAMES:
            raise ValueError(f"GGUF tensor '{gguf_name}' has no Hugging Face counterpart")
        module = _LLAMA_BLOCK_NAMES[match["stem"]]
        return f"model.layers.{match['layer']}.{module}.{match['kind']}"

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every tensor in file order, float32, in HF shapes
        (``(out_features, in_features)`` for linear weights, ``(vocab, hidden)`` for the
        embedding). ``lm_head.weight`` appears only when the file has an untied output."""
        for tensor in self.tensors:
            name = self.hf_name(tensor.name)
            weight = _dequantize_tensor(tensor)
            if ".self_attn.q_proj." in name:
                weight = unpermute_rotary_rows(weight, self.config.num_attention_heads)
            elif ".self_attn.k_proj." in name:
                weight = unpermute_rotary_rows(weight, self.config.num_key_value_heads)
            yield name, weight


def _dequantize_tensor(tensor: GgufTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to float32, shaped ``reversed(tensor.shape)`` (torch order)."""
    values = dequantize(tensor.data, tensor.tensor_type)
    # Unquantized types come back as views of the read-only memory map; torch needs writable
    # memory, so those (and only those) are copied.
    values = np.require(values, dtype=np.float32, requirements=["C", "W"])
    torch_shape = tuple(reversed(tensor.shape))
    return torch.from_numpy(values).reshape(torch_shape)


def load_gguf(path: str) -> GGUFCheckpoint:
    """Open a GGUF file and build its HF config; tensors are read later by ``weights()``.

    Raises:
        ValueError: when the architecture, rope variant or a tensor is not supported.
    """
    header = read_header(path)
    tensor_names = [tensor.name for tensor in header.tensors]
    config = config_from_gguf_metadata(header.metadata, tensor_names)
    checkpoint = GGUFCheckpoint(path=path, tensors=header.tensors, metadata=header.metadata,
                                config=config)
    # Fail at load time, not halfway through streaming the weights.
    for name in tensor_names:
        checkpoint.hf_name(name)
    return checkpoint
