"""Offline engine: input processor + engine core(s) + output processor, stepped by the
caller (the offline ``LLM`` and benchmarks). One rank runs its engine core in-process; several
data-parallel ranks run as processes behind the same client the server uses."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from widellm.engine.arg_utils import EngineArgs
from widellm.core.outputs import EngineCoreOutput
from widellm.engine.core_client import (
    DEATH_NOTICE_S, DEATH_POLL_S, EngineCoreClient, EngineDeadError,
)
from widellm.engine.engine_core import EngineCore
from widellm.engine.output_processor import OutputProcessor, RequestOutputKind
from widellm.engine.processor import InputProcessor, PromptType
from widellm.outputs import RequestOutput
from widellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the offline loop waits for the ranks' outputs before checking they are alive.
HEALTH_POLL_S = 0.5


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.config = engine_args.create_engine_config()
        mc = self.config.model_config
        torch.manual_seed(mc.seed)
        self.processor = InputProcessor.from_model_config(
            mc, self.config.kv_transfer_config, self.config.structured_outputs_config.backend)
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        if self.config.parallel_config.data_parallel_size == 1:
            self.engine_core: EngineCore | None = EngineCore(self.config)
            self.client: EngineCoreClient | None = None
        else:
            self.engine_core = None
            self.client = EngineCoreClient(self.config)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_requests(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        data_parallel_ranks: list[int | None] | None = None,
    ) -> list[str]:
        """Validate every prompt first, then add them all: one bad prompt adds nothing.
        ``data_parallel_ranks`` pins prompts to ranks (None entries: the balancer picks)."""
        ranks = data_parallel_ranks or [None] * len(prompts)
        if len(ranks) != len(prompts):
            raise ValueError(f"data_parallel_rank: {len(ranks)} given for {len(prompts)} prompts")
        prepared = []
        for prompt, p, rank in zip(prompts, params, ranks, strict=True):
            text, token_ids = self.processor.tokenize(prompt)
            self.processor.validate_prompt(token_ids)
            self.processor.validate_params(p)
            salt = self.processor.cache_salt(prompt)
            if rank is not None:
                if self.client is None and rank != 0:
                    raise ValueError(f"data_parallel_rank {rank}: there is only rank 0")
                if self.client is not None:
                    self.client.check_rank(rank)
            prepared.append((text, token_ids, p, rank, salt))
        request_ids = []
        for text, token_ids, p, rank, salt in prepared:
            rid = self.next_request_id()
            core_ids = self.output_processor.add_request(rid, text, token_ids, p, kind)
            core_reqs = self.processor.make_core_requests(rid, token_ids, p, core_ids, salt)
            if self.client is not None:
                self.client.add_requests(core_reqs, rank)
            else:
                for req in core_reqs:
                    self.engine_core.add_request(req)
            request_ids.append(rid)
        return request_ids

    def abort_requests(self, request_ids: list[str]) -> None:
        self._abort_core(self.output_processor.abort_requests(request_ids))

    def _abort_core(self, core_ids: list[str]) -> None:
        if self.client is not None:
            self.client.abort_requests(core_ids)
        else:
            self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        if self.client is not None:
            return self.output_processor.has_unfinished_requests()
        return self.engine_core.has_unfinished_requests() or self.engine_core.has_loads_in_flight()

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.output_processor.process_outputs(self._core_step())
        if to_abort:
            self._abort_core(to_abort)
        return outputs

    def _core_step(self) -> list[EngineCoreOutput]:
        if self.client is None:
            return self.engine_core.step()
        batch = self.client.get_output(HEALTH_POLL_S)
        if batch is None:
            if not self.client.is_alive():
                raise EngineDeadError(self.client.dead_reason())
            return []
        if batch.engine_error is not None:
            deadline = time.monotonic() + DEATH_NOTICE_S
            while self.client.others_alive(batch.dp_rank) and time.monotonic() < deadline:
                time.sleep(DEATH_POLL_S)
            raise EngineDeadError(self.client.failure_reason(batch.dp_rank, batch.engine_error))
        return batch.outputs

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()
            self.client = None
        elif self.engine_core is not None:
            self.engine_core.shutdown()
