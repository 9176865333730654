"""``widellm bench serve`` against a tiny fake OpenAI server streaming on a known schedule,
run by uvicorn in a background thread on a free local port."""

import argparse
import asyncio
import json
import socket
import threading
import time
from contextlib import ExitStack, contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from widellm.bench.datasets import random_token_prompts
from widellm.bench.serve_args import add_cli_args
from widellm.bench.serve import (
    CHAT_ENDPOINT,
    RequestSettings,
    SampleRequest,
    arrival_offsets,
    benchmark,
    build_samples,
    chunk_text,
    main,
    parse_sse_data,
    wait_until_ready,
)

MODEL_NAME = "fake-model"
NUM_CHUNKS = 5
# Each chunk stands for this many tokens, so the usage count differs from the chunk count.
TOKENS_PER_CHUNK = 2
FIRST_DELAY_S = 0.05
CHUNK_DELAY_S = 0.02
SERVER_START_TIMEOUT_S = 10.0
POLL_S = 0.01
# How long the late server of the ready-check test stays unreachable.
LATE_START_S = 1.0


def make_app(
    *, send_usage: bool = True, fail_every: int = 0, error_mid_stream: bool = False
) -> FastAPI:
    """A server that streams NUM_CHUNKS chunks (after FIRST_DELAY_S, then CHUNK_DELAY_S
    apart), then a usage chunk; with ``fail_every`` = k, every k-th request gets a 400; with
    ``error_mid_stream``, an error event follows the first chunk."""
    app = FastAPI()
    app.state.payloads = []
    app.state.in_flight = 0
    app.state.max_in_flight = 0
    app.state.num_received = 0

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream(payload: dict, chat: bool):
        async def gen():
            try:
                if chat:  # like vLLM: a role-only first delta that carries no text
                    yield sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]})
                for i in range(NUM_CHUNKS):
                    await asyncio.sleep(FIRST_DELAY_S if i == 0 else CHUNK_DELAY_S)
                    choice = ({"index": 0, "delta": {"content": "ab"}} if chat
                              else {"index": 0, "text": "ab"})
                    yield sse({"choices": [choice], "usage": None})
                    if error_mid_stream:
                        yield sse({"error": {"message": "engine died"}})
                        return
                if send_usage:
                    prompt = payload.get("prompt") or payload["messages"][0]["content"]
                    yield sse({"choices": [], "usage": {
                        "prompt_tokens": len(prompt),
                        "completion_tokens": NUM_CHUNKS * TOKENS_PER_CHUNK}})
                yield "data: [DONE]\n\n"
            finally:
                app.state.in_flight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def handle(request: Request, chat: bool):
        payload = await request.json()
        app.state.num_received += 1
        if fail_every and app.state.num_received % fail_every == 0:
            return JSONResponse({"error": {"message": "bad request"}}, status_code=400)
        app.state.payloads.append(payload)
        app.state.in_flight += 1
        app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
        return stream(payload, chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _bound_socket() -> socket.socket:
    """A socket on a free 127.0.0.1 port, handed to uvicorn so no other process can take
    the port between choosing and listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serve_app(app: FastAPI, sock: socket.socket | None = None):
    """Run ``app`` in a background thread (on ``sock`` if given); yield its base URL; always
    stop the thread."""
    sock = sock or _bound_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(POLL_S)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(SERVER_START_TIMEOUT_S)
        sock.close()
        assert not thread.is_alive(), "server thread did not stop"


@pytest.fixture
def fake_server():
    """Start fake servers on demand (``start(app) -> base_url``), all stopped at teardown
    whether the test passed or not."""
    with ExitStack() as stack:
        yield lambda app: stack.enter_context(serve_app(app))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([*argv, "--disable-tqdm"])


def test_parse_sse_data_and_chunk_text():
    assert parse_sse_data('data: {"a": 1}') == '{"a": 1}'
    assert parse_sse_data("data:[DONE]\n") == "[DONE]"
    assert parse_sse_data("") is None
    assert parse_sse_data(": keep-alive") is None
    assert parse_sse_data("event: message") is None
    assert chunk_text({"choices": [{"text": "hi"}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "hm"}}]}) == "hm"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_arrival_offsets_are_seeded_poisson_or_all_at_once():
    assert arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(200, 50.0, seed=1)
    assert offsets == arrival_offsets(200, 50.0, seed=1)
    assert offsets != arrival_offsets(200, 50.0, seed=2)
    assert offsets[0] == 0.0
    assert all(b > a for a, b in zip(offsets, offsets[1:]))


def test_main_measures_streamed_requests_and_writes_json(fake_server, tmp_path):
    app = make_app()
    base_url = fake_server(app)
    out = tmp_path / "result.json"
    num_prompts, input_len, vocab = 4, 8, 1000
    result = main(_args(
        "--base-url", base_url, "--vocab-size", str(vocab), "--num-prompts", str(num_prompts),
        "--input-len", str(input_len), "--output-len", str(NUM_CHUNKS * TOKENS_PER_CHUNK),
        "--request-rate", "100", "--seed", "3", "--output-json", str(out),
    ))
    assert result["model"] == MODEL_NAME  # found through /v1/models
    assert (result["completed"], result["failed"]) == (num_prompts, 0)
    assert result["total_input_tokens"] == num_prompts * input_len
    assert result["total_output_tokens"] == num_prompts * NUM_CHUNKS * TOKENS_PER_CHUNK
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["request_rate"] == 100.0
    min_e2e = FIRST_DELAY_S + (NUM_CHUNKS - 1) * CHUNK_DELAY_S
    for rec in result["requests"]:
        assert rec["success"] and rec["error"] == ""
        assert rec["ttft"] >= FIRST_DELAY_S
        assert len(rec["itl"]) == NUM_CHUNKS - 1
        assert rec["latency"] >= min_e2e
        assert rec["output_tokens"] == NUM_CHUNKS * TOKENS_PER_CHUNK
    assert result["mean_ttft_ms"] >= FIRST_DELAY_S * 1000
    assert result["num_warmups"] == 0
    # First the untimed test prompt, drawn after the timed ones; then the timed prompts.
    prompts = random_token_prompts(num_prompts + 1, input_len, vocab, seed=3)
    assert app.state.payloads[0]["prompt"] == prompts[-1]
    assert sorted(p["prompt"] for p in app.state.payloads[1:]) == sorted(prompts[:-1])
    first = app.state.payloads[0]
    assert first["model"] == MODEL_NAME
    assert first["max_tokens"] == first["min_tokens"] == NUM_CHUNKS * TOKENS_PER_CHUNK
    assert first["ignore_eos"] is True and first["temperature"] == 0.0
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}


def test_failed_requests_are_counted_not_raised(fake_server):
    app = make_app(fail_every=2)
    result = main(_args("--base-url", fake_server(app), "--model", MODEL_NAME,
                        "--vocab-size", "500", "--num-prompts", "6", "--input-len", "4",
                        "--output-len", "3", "--ready-check-timeout-sec", "0"))
    assert (result["completed"], result["failed"]) == (3, 3)
    failed = [r for r in result["requests"] if not r["success"]]
    assert all(r["error"].startswith("HTTP 400") for r in failed)
    # Only successes count: 3 requests of NUM_CHUNKS * TOKENS_PER_CHUNK tokens.
    assert result["total_output_tokens"] == 3 * NUM_CHUNKS * TOKENS_PER_CHUNK


def test_error_event_inside_the_stream_fails_the_request(fake_server):
    app = make_app(error_mid_stream=True)
    result = main(_args("--base-url", fake_server(app), "--model", MODEL_NAME,
                        "--vocab-size", "500", "--num-prompts", "2", "--input-len", "4",
                        "--output-len", "3", "--ready-check-timeout-sec", "0"))
    assert (result["completed"], result["failed"]) == (0, 2)
    assert all("engine died" in r["error"] for r in result["requests"])


def test_unreachable_server_fails_every_request():
    sock = _bound_socket()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        result = main(_args("--base-url", url, "--model", MODEL_NAME, "--vocab-size", "500",
                            "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                            "--ready-check-timeout-sec", "0"))
    finally:
        sock.close()
    assert (result["completed"], result["failed"]) == (0, 2)
    assert all(r["error"].startswith("ConnectError") for r in result["requests"])


def test_ready_check_waits_for_a_server_that_starts_late():
    app = make_app()
    sock = _bound_socket()  # refuses connections until uvicorn listens on it
    settings = RequestSettings(api_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions",
                               model=MODEL_NAME, output_len=NUM_CHUNKS)
    stop = threading.Event()

    def start_late() -> None:
        time.sleep(LATE_START_S)
        with serve_app(app, sock):
            stop.wait()

    thread = threading.Thread(target=start_late, daemon=True)
    start = time.monotonic()
    thread.start()
    try:
        record = asyncio.run(wait_until_ready(settings, SampleRequest([7, 8], 2), timeout_s=30))
    finally:
        stop.set()
        thread.join(SERVER_START_TIMEOUT_S)
    assert not thread.is_alive()
    assert record.success and record.output_tokens == NUM_CHUNKS * TOKENS_PER_CHUNK
    assert time.monotonic() - start >= LATE_START_S
    assert [p["prompt"] for p in app.state.payloads] == [[7, 8]]


def test_ready_check_gives_up_on_a_server_that_never_listens():
    sock = _bound_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="initial test request .* ConnectError"):
            main(_args("--base-url", url, "--model", MODEL_NAME, "--vocab-size", "500",
                       "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                       "--ready-check-timeout-sec", "2"))
    finally:
        sock.close()
    assert time.monotonic() - start < SERVER_START_TIMEOUT_S


def test_ready_check_fails_at_once_when_the_server_rejects_the_request(fake_server):
    app = make_app(fail_every=1)
    with pytest.raises(RuntimeError, match="HTTP 400: .*bad request"):
        main(_args("--base-url", fake_server(app), "--model", MODEL_NAME, "--vocab-size",
                   "500", "--num-prompts", "3", "--input-len", "4", "--output-len", "2"))
    assert app.state.num_received == 1  # no retry, no timed request


def test_warmups_are_untimed_and_use_their_own_prompts(fake_server):
    app = make_app()
    num_prompts, num_warmups, input_len, vocab = 3, 4, 5, 700
    result = main(_args("--base-url", fake_server(app), "--model", MODEL_NAME, "--vocab-size",
                        str(vocab), "--num-prompts", str(num_prompts), "--input-len",
                        str(input_len), "--output-len", "2", "--num-warmups", str(num_warmups),
                        "--max-concurrency", "2", "--seed", "5"))
    assert result["num_warmups"] == num_warmups
    assert (result["completed"], len(result["requests"])) == (num_prompts, num_prompts)
    prompts = random_token_prompts(num_prompts + 1 + num_warmups, input_len, vocab, seed=5)
    sent = [p["prompt"] for p in app.state.payloads]
    assert sent[0] == prompts[num_prompts]  # the test prompt
    assert sorted(sent[1:1 + num_warmups]) == sorted(prompts[num_prompts + 1:])
    assert sorted(sent[1 + num_warmups:]) == sorted(prompts[:num_prompts])
    assert app.state.max_in_flight == 2


def test_negative_warmups_are_rejected():
    with pytest.raises(ValueError, match="--num-warmups"):
        main(_args("--model", MODEL_NAME, "--vocab-size", "500", "--num-warmups", "-1"))


def test_chat_without_usage_counts_chunks_and_honours_max_concurrency(fake_server):
    app = make_app(send_usage=False)
    settings = RequestSettings(api_url=fake_server(app) + CHAT_ENDPOINT, model=MODEL_NAME,
                               output_len=NUM_CHUNKS)
    samples = [SampleRequest("hello there", prompt_len=2) for _ in range(4)]
    records, duration = asyncio.run(benchmark(settings, samples, max_concurrency=2))
    assert [r.success for r in records] == [True] * 4
    # No usage chunk: one token per content chunk; the empty role chunk is not a token.
    assert [r.output_tokens for r in records] == [NUM_CHUNKS] * 4
    assert [len(r.itl) for r in records] == [NUM_CHUNKS - 1] * 4
    assert all(r.ttft >= FIRST_DELAY_S for r in records)
    assert app.state.max_in_flight == 2
    # Two waves of two requests, each at least the stream's own duration.
    assert duration >= 2 * (FIRST_DELAY_S + (NUM_CHUNKS - 1) * CHUNK_DELAY_S)
    payload = app.state.payloads[0]
    assert payload["messages"] == [{"role": "user", "content": "hello there"}]
    assert payload["max_completion_tokens"] == payload["max_tokens"] == NUM_CHUNKS
    assert "prompt" not in payload


def test_chat_needs_a_tokenizer():
    args = _args("--endpoint", CHAT_ENDPOINT, "--vocab-size", "500", "--model", "m")
    with pytest.raises(ValueError, match="--tokenizer"):
        build_samples(args, is_chat=True)


def _word_level_tokenizer(path, vocab_size: int) -> None:
    """A tokenizer folder whose token i is the word ``t{i}``, so decoded text is checkable."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


def test_prompts_from_a_tokenizer_folder(tmp_path):
    vocab = 300
    _word_level_tokenizer(tmp_path, vocab)
    common = ("--tokenizer", str(tmp_path), "--num-prompts", "3", "--input-len", "5",
              "--seed", "7")
    expected = random_token_prompts(3, 5, vocab, seed=7)
    # Completions: ids as they are, the vocabulary size taken from the tokenizer.
    samples = build_samples(_args(*common), is_chat=False)
    assert [s.prompt for s in samples] == expected
    assert [s.prompt_len for s in samples] == [5, 5, 5]
    # Chat: the same ids decoded to text.
    samples = build_samples(_args(*common, "--endpoint", CHAT_ENDPOINT), is_chat=True)
    assert [s.prompt for s in samples] == [" ".join(f"t{i}" for i in p) for p in expected]
