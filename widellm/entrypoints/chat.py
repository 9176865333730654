"""Terminal chat: the conversation so far goes through the model's chat template each turn and
the reply streams to the terminal token by token."""

from __future__ import annotations

import sys

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.llm_engine import LLMEngine
from widellm.engine.output_processor import RequestOutputKind
from widellm.sampling_params import SamplingParams

PROMPT = "> "
EXIT_WORDS = {"exit", "quit", "/exit", "/quit"}


def stream_reply(engine: LLMEngine, messages: list[dict], params: SamplingParams,
                 out=sys.stdout) -> str:
    """Generate the assistant's reply to ``messages``, writing text as it arrives."""
    token_ids = engine.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    engine.add_requests([{"prompt_token_ids": token_ids}], [params], RequestOutputKind.DELTA)
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                pieces.append(completion.text)
                out.write(completion.text)
                out.flush()
    out.write("\n")
    return "".join(pieces)


def run_chat(args: EngineArgs, params: SamplingParams, message: str | None) -> None:
    engine = LLMEngine(args)
    messages: list[dict] = []
    if message is not None:
        stream_reply(engine, [{"role": "user", "content": message}], params)
        return
    print("Type a message (exit or Ctrl-D to quit).")
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            break
        if line.strip().lower() in EXIT_WORDS:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = stream_reply(engine, messages, params)
        messages.append({"role": "assistant", "content": reply})
