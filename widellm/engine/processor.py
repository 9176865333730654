"""Turning user input into engine-core requests: tokenize, validate, fill defaults.

Validation happens here, before anything reaches the engine core, so a bad request is refused
with a ValueError naming the parameter and never disturbs the others.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from widellm.config import ModelConfig
from widellm.engine.engine_core import EngineCoreRequest
from widellm.engine.tokenizer import get_tokenizer, max_chars_per_token
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.registry import supports_streaming
from widellm.model.loader import load_eos_token_ids
from widellm.sampling_params import SamplingParams
from widellm.structured_output.registry import backend_class

# A prompt: text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...} as in vLLM, the
# dict optionally with "cache_salt".
PromptType = str | Sequence[int] | dict[str, Any]
# A proxy's transfer ids are uuids (32 hex digits); anything far longer is not one.
MAX_TRANSFER_ID_CHARS = 128


class InputProcessor:
    @classmethod
    def from_model_config(cls, model_config: ModelConfig,
                          kv_transfer_config: KVTransferConfig | None = None,
                          structured_outputs_backend: str = "auto") -> "InputProcessor":
        """Tokenizer and EOS ids (generation config first, else the tokenizer's EOS)."""
        tokenizer = get_tokenizer(model_config.tokenizer)
        eos = load_eos_token_ids(model_config.model, model_config.hf_config)
        if not eos and tokenizer.eos_token_id is not None:
            eos = [tokenizer.eos_token_id]
        return cls(model_config, tokenizer, eos, kv_transfer_config, structured_outputs_backend)

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: list[int],
        kv_transfer_config: KVTransferConfig | None = None,
        structured_outputs_backend: str = "auto",
    ) -> None:
        self.model_config = model_config
        self.structured_outputs_backend = structured_outputs_backend
        self.kv_transfer_config = kv_transfer_config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model_config.hf_config.vocab_size
        # Computed once: it walks the vocabulary.
        self.max_chars_per_token = (max_chars_per_token(tokenizer)
                                    if tokenizer is not None else None)

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """Refuse text too long to fit in max_model_len whatever it encodes to, without
        tokenizing it: no token covers more than ``max_chars_per_token`` characters."""
        per_token = self.max_chars_per_token
        max_len = self.model_config.max_model_len
        if per_token is None:
            return
        min_tokens = -(-len(text) // per_token)
        if min_tokens > max_len:
            raise ValueError(
                f"{param}: {len(text)} characters are at least {min_tokens} tokens (no token of "
                f"this tokenizer covers more than {per_token} characters), more than "
                f"max_model_len={max_len}")

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True,
                 check_length: bool = True) -> tuple[str | None, list[int]]:
        """(text or None, token ids); text is encoded with the tokenizer's special tokens (a
        BOS, for most) unless ``add_special_tokens`` is false (text that already has them),
        and refused unread when too long to fit unless not ``check_length`` (a prompt the
        caller truncates after encoding)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer; pass token ids instead")
            if check_length:
                self.check_text_length(prompt)
            return prompt, list(self.tokenizer(
                prompt, add_special_tokens=add_special_tokens).input_ids)
        return None, [int(t) for t in prompt]

    @staticmethod
    def cache_salt(prompt: PromptType, cache_salt: str | None = None) -> str | None:
        """The request's ``cache_salt``: the argument or the prompt dict's (not two different
        ones). Requests with different salts never share a prefix-cache block; without one a
        request shares with every other unsalted request."""
        from_prompt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and from_prompt is not None and cache_salt != from_prompt:
            raise ValueError("cache_salt: given in the prompt and as an argument, differently")
        salt = from_prompt if cache_salt is None else cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt: must be a non-empty string if given, got {salt!r}")
        return salt

    def validate_prompt(self, token_ids: list[int]) -> None:
        max_len = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        if len(token_ids) > max_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens is longer than max_model_len={max_len}"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: {bad[:3]} outside the vocabulary [0, {self.vocab_size})"
            )

    def validate_params(self, params: SamplingParams,
                        structured_param: str = "structured_outputs") -> None:
        """What only the model can check: logit_bias ids in the vocabulary, a structured
        output's constraint (parsed, not compiled; ``structured_param`` names the request
        field that carried it), and a KV transfer against this instance's connector (so that a
        streamed request is refused with its status, before its stream starts)."""
        self.kv_transfer_params(params, params.n)
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name}: token ids {bad[:3]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if params.structured_outputs is not None:
            try:
                backend_class(self.structured_outputs_backend).validate(
                    params.structured_outputs)
            except ValueError as e:
                raise ValueError(f"{structured_param}: {e}") from None

    def make_core_requests(
        self, request_id: str, token_ids: list[int], params: SamplingParams,
        core_ids: list[str], cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine-core request per sample (``core_ids`` from the output processor)."""
        room = self.model_config.max_model_len - len(token_ids)
        max_tokens = max(1, room) if params.max_tokens is None else params.max_tokens
        kv_params = self.kv_transfer_params(params, len(core_ids))
        now = time.monotonic()
        requests = []
        for i, core_id in enumerate(core_ids):
            child = params.clone()
            child.n = 1
            if params.seed is not None and len(core_ids) > 1:
                child.seed = params.seed + i  # siblings must not draw identical samples
            requests.append(EngineCoreRequest(
                request_id=core_id,
                prompt_token_ids=token_ids,
                sampling_params=child,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                arrival_time=now,
                cache_salt=cache_salt,
                kv_transfer_params=kv_params,
            ))
        return requests

    def kv_transfer_params(self, params: SamplingParams, n: int) -> dict | None:
        """``extra_args["kv_transfer_params"]`` checked against this instance's connector: a
        request for a transfer the instance cannot make is refused, never ignored."""
        kv = (params.extra_args or {}).get("kv_transfer_params")
        if kv is None:
            return None
        if not isinstance(kv, dict):
            raise ValueError("kv_transfer_params: must be an object")
        remote_prefill, remote_decode = bool(kv.get("do_remote_prefill")), bool(
            kv.get("do_remote_decode"))
        if not (remote_prefill or remote_decode):
            return None
        cfg = self.kv_transfer_config
        if cfg is None:
            raise ValueError("kv_transfer_params: this instance runs no KV connector "
                             "(start it with --kv-transfer-config)")
        if remote_prefill and remote_decode:
            raise ValueError("kv_transfer_params: do_remote_prefill and do_remote_decode "
                             "cannot both be set")
        if remote_decode and not cfg.is_producer:
            raise ValueError(f"kv_transfer_params: do_remote_decode needs a kv_producer or "
                             f"kv_both instance; this one is {cfg.kv_role}")
        if remote_prefill and not cfg.is_consumer:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs a kv_consumer or "
                             f"kv_both instance; this one is {cfg.kv_role}")
        if "transfer_id" in kv:
            tid = kv["transfer_id"]
            if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID_CHARS:
                raise ValueError(f"kv_transfer_params: transfer_id must be a string of 1 to "
                                 f"{MAX_TRANSFER_ID_CHARS} characters")
            if not supports_streaming(cfg):
                raise ValueError(f"kv_transfer_params: transfer_id (a streamed transfer) "
                                 f"needs TCPConnector; this instance runs {cfg.kv_connector}")
        if remote_prefill and params.prompt_logprobs is not None:
            raise ValueError("kv_transfer_params: prompt logprobs need the prompt computed "
                             "here; send the request without do_remote_prefill")
        if n > 1:
            # Every sample would pull the same remote blocks, and one lease serves one pull.
            raise ValueError("kv_transfer_params: n > 1 is not supported with a remote "
                             "prefill or decode; send n > 1 to one instance")
        return kv
