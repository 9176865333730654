"""The offline API, in vLLM's shape::

    from widellm import LLM, SamplingParams
    llm = LLM(model="preset:deepseek-v3-tiny", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.llm_engine import LLMEngine
from widellm.engine.processor import PromptType
from widellm.outputs import RequestOutput
from widellm.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        data_parallel_rank: int | Sequence[int | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single string, token-id list or dict counts
        as one prompt; a dict prompt may carry a ``cache_salt`` (``{"prompt": "Hi",
        "cache_salt": "tenant-a"}``): prompts with different salts never share cached KV.
        ``data_parallel_rank`` pins all prompts (an int) or each (a list) to a rank; by
        default the load balancer picks."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(params)} given for {len(prompts)} prompts"
                )
        if data_parallel_rank is None or isinstance(data_parallel_rank, int):
            ranks = [data_parallel_rank] * len(prompts)
        else:
            ranks = list(data_parallel_rank)
        request_ids = self.llm_engine.add_requests(prompts, params, data_parallel_ranks=ranks)
        return self._run_engine(request_ids, use_tqdm)

    def shutdown(self) -> None:
        """Stop the engine-core processes (data-parallel ranks) now rather than at exit."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them;
        ``cache_salt`` salts every conversation's prefix-cache keys (see ``generate``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tokenizer.apply_chat_template(
                conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, return_dict=False,
            ), **({} if cache_salt is None else {"cache_salt": cache_salt})}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.set_postfix_str(
                            f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s"
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_requests(request_ids)
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]
