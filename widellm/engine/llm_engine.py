"""In-process engine: input processor + engine core + output processor, stepped by the
caller (the offline ``LLM`` and benchmarks). The server uses the same pieces with the engine
core in its own process."""

from __future__ import annotations

import itertools
import logging

import torch

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.engine_core import EngineCore
from widellm.engine.output_processor import OutputProcessor, RequestOutputKind
from widellm.engine.processor import InputProcessor, PromptType
from widellm.outputs import RequestOutput
from widellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.config = engine_args.create_engine_config()
        mc = self.config.model_config
        torch.manual_seed(mc.seed)
        self.processor = InputProcessor.from_model_config(mc)
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(self.config)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_requests(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> list[str]:
        """Validate every prompt first, then add them all: one bad prompt adds nothing."""
        prepared = []
        for prompt, p in zip(prompts, params, strict=True):
            text, token_ids = self.processor.tokenize(prompt)
            self.processor.validate_prompt(token_ids)
            prepared.append((text, token_ids, p))
        request_ids = []
        for text, token_ids, p in prepared:
            rid = self.next_request_id()
            core_ids = self.output_processor.add_request(rid, text, token_ids, p, kind)
            for req in self.processor.make_core_requests(rid, token_ids, p, core_ids):
                self.engine_core.add_request(req)
            request_ids.append(rid)
        return request_ids

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.output_processor.process_outputs(self.engine_core.step())
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return outputs
