"""``widellm bench serve`` against a tiny fake OpenAI server streaming on a known schedule,
run by uvicorn in a background thread on a free local port."""

import asyncio
import json
import math
import threading
import time
from contextlib import ExitStack

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.bench.bench_utils import (
    SERVER_START_TIMEOUT_S, bound_socket, parse_bench_args, serve_app, word_level_tokenizer,
)
from widellm.bench.datasets import random_token_prompts
from widellm.bench.serve import (
    CHAT_ENDPOINT,
    BenchServeError,
    RequestSettings,
    SampleRequest,
    arrival_offsets,
    benchmark,
    chunk_text,
    main,
    parse_sse_data,
    wait_until_ready,
)

MODEL_NAME = "fake-model"
NUM_CHUNKS = 5
# Each chunk carries this many words (tokens of the word-level tokenizer), so the usage
# count differs from the chunk count.
TOKENS_PER_CHUNK = 2
CHUNK_TEXT = " t1 t2"
FIRST_DELAY_S = 0.05
CHUNK_DELAY_S = 0.02
# How long the late server of the ready-check test stays unreachable.
LATE_START_S = 1.0
VOCAB = 300
# What a request may carry when no flag asks for an extra: OpenAI's own fields.
OPENAI_COMPLETION_KEYS = {"model", "prompt", "max_tokens", "stream", "stream_options"}


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
                    choice = ({"index": 0, "delta": {"content": CHUNK_TEXT}} if chat
                              else {"index": 0, "text": CHUNK_TEXT})
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
            # Pretty-printed, as some servers send it: the body spans several lines.
            return Response(json.dumps({"error": {"message": "bad request"}}, indent=2),
                            status_code=400, media_type="application/json")
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


@pytest.fixture
def fake_server():
    """Start fake servers on demand (``start(app) -> base_url``), all stopped at teardown
    whether the test passed or not."""
    with ExitStack() as stack:
        yield lambda app: stack.enter_context(serve_app(app))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("word_tokenizer")
    word_level_tokenizer(path, VOCAB)
    return str(path)


def _token_id_args(base_url: str, *argv: str):
    """A run of token-id prompts (no tokenizer needed) against ``base_url``."""
    return parse_bench_args("--base-url", base_url, "--token-id-prompts", "--vocab-size", "500",
                            *argv)


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


def test_arrival_offsets_are_seeded_gamma_or_all_at_once():
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(2000, 50.0, seed=1)
    assert offsets == arrival_offsets(2000, 50.0, seed=1)
    assert offsets != arrival_offsets(2000, 50.0, seed=2)
    assert offsets[0] == 0.0
    assert all(b > a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] / 1999 == pytest.approx(1 / 50.0, rel=0.1)  # mean gap 1 / rate
    # Infinite burstiness: evenly spaced; burstier arrivals keep the mean gap.
    assert arrival_offsets(4, 10.0, seed=0, burstiness=math.inf) == pytest.approx(
        [0.0, 0.1, 0.2, 0.3])
    bursty = arrival_offsets(2000, 50.0, seed=1, burstiness=0.25)
    assert bursty[-1] / 1999 == pytest.approx(1 / 50.0, rel=0.2)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert max(gaps) > max(b - a for a, b in zip(offsets, offsets[1:]))


def test_main_measures_streamed_requests_and_writes_json(fake_server, tmp_path):
    app = make_app()
    base_url = fake_server(app)
    out = tmp_path / "result.json"
    num_prompts, input_len, vocab = 4, 8, 1000
    output_len = NUM_CHUNKS * TOKENS_PER_CHUNK
    result = main(parse_bench_args(
        "--base-url", base_url, "--token-id-prompts", "--vocab-size", str(vocab),
        "--num-prompts", str(num_prompts), "--input-len", str(input_len),
        "--output-len", str(output_len), "--request-rate", "100", "--seed", "3",
        "--fixed-output-len", "--temperature", "0", "--save-detailed",
        "--output-json", str(out),
    ))
    assert result["model_id"] == MODEL_NAME  # found through /v1/models
    assert (result["completed"], result["failed"]) == (num_prompts, 0)
    assert result["total_input_tokens"] == num_prompts * input_len
    assert result["total_output_tokens"] == num_prompts * output_len
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["request_rate"] == 100.0
    assert result["errors"] == [""] * num_prompts
    assert all(t >= FIRST_DELAY_S for t in result["ttfts"])
    assert [len(gaps) for gaps in result["itls"]] == [NUM_CHUNKS - 1] * num_prompts
    min_e2e = FIRST_DELAY_S + (NUM_CHUNKS - 1) * CHUNK_DELAY_S
    assert all(lat >= min_e2e for lat in result["latencies"])
    assert result["output_lens"] == [output_len] * num_prompts
    assert result["generated_texts"] == [CHUNK_TEXT * NUM_CHUNKS] * num_prompts
    assert result["mean_ttft_ms"] >= FIRST_DELAY_S * 1000
    assert result["num_warmups"] == 0
    # First the untimed test prompt, drawn after the timed ones; then the timed prompts.
    prompts = random_token_prompts(num_prompts + 1, input_len, vocab, seed=3)
    assert app.state.payloads[0]["prompt"] == prompts[-1]
    assert sorted(p["prompt"] for p in app.state.payloads[1:]) == sorted(prompts[:-1])
    first = app.state.payloads[0]
    assert first["model"] == MODEL_NAME
    # Asked for: exact output lengths and greedy sampling.
    assert first["max_tokens"] == first["min_tokens"] == output_len
    assert first["ignore_eos"] is True and first["temperature"] == 0.0
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}


def test_default_requests_are_text_with_openai_fields_only(fake_server, tokenizer_dir):
    app = make_app()
    result = main(parse_bench_args("--base-url", fake_server(app), "--tokenizer", tokenizer_dir,
                                   "--num-prompts", "3", "--random-input-len", "6",
                                   "--random-output-len", "4"))
    assert result["completed"] == 3 and result["tokenizer_id"] == tokenizer_dir
    for payload in app.state.payloads:
        assert set(payload) == OPENAI_COMPLETION_KEYS
        words = payload["prompt"].split()
        assert len(words) == 6 and all(w.startswith("t") for w in words)
        assert payload["max_tokens"] == 4


def test_failed_requests_are_counted_not_raised(fake_server):
    app = make_app(fail_every=2)
    result = main(_token_id_args(fake_server(app), "--model", MODEL_NAME, "--num-prompts", "6",
                                 "--input-len", "4", "--output-len", "3", "--save-detailed",
                                 "--ready-check-timeout-sec", "0"))
    assert (result["completed"], result["failed"]) == (3, 3)
    failed = [e for e in result["errors"] if e]
    # The server's multi-line error body is kept on one line.
    assert len(failed) == 3 and all(e.startswith('HTTP 400: { "error": { "message": "bad')
                                    and "\n" not in e for e in failed)
    # Only successes count: 3 requests of NUM_CHUNKS * TOKENS_PER_CHUNK tokens.
    assert result["total_output_tokens"] == 3 * NUM_CHUNKS * TOKENS_PER_CHUNK
    assert sorted(result["output_lens"]) == [0] * 3 + [NUM_CHUNKS * TOKENS_PER_CHUNK] * 3


def test_error_event_inside_the_stream_fails_the_request(fake_server):
    app = make_app(error_mid_stream=True)
    result = main(_token_id_args(fake_server(app), "--model", MODEL_NAME, "--num-prompts", "2",
                                 "--input-len", "4", "--output-len", "3", "--save-detailed",
                                 "--ready-check-timeout-sec", "0"))
    assert (result["completed"], result["failed"]) == (0, 2)
    assert all("engine died" in e for e in result["errors"])


def test_unreachable_server_fails_every_request():
    sock = bound_socket()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        result = main(_token_id_args(url, "--model", MODEL_NAME, "--num-prompts", "2",
                                     "--input-len", "4", "--output-len", "2", "--save-detailed",
                                     "--ready-check-timeout-sec", "0"))
    finally:
        sock.close()
    assert (result["completed"], result["failed"]) == (0, 2)
    assert all(e.startswith("ConnectError") for e in result["errors"])


def test_ready_check_waits_for_a_server_that_starts_late():
    app = make_app()
    sock = bound_socket()  # refuses connections until uvicorn listens on it
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
    sock = bound_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    try:
        with pytest.raises(BenchServeError, match="initial test request .* ConnectError"):
            main(_token_id_args(url, "--model", MODEL_NAME, "--num-prompts", "2",
                                "--input-len", "4", "--output-len", "2",
                                "--ready-check-timeout-sec", "2"))
    finally:
        sock.close()
    assert time.monotonic() - start < SERVER_START_TIMEOUT_S


def test_ready_check_fails_at_once_when_the_server_rejects_the_request(fake_server):
    app = make_app(fail_every=1)
    with pytest.raises(BenchServeError, match="HTTP 400: .*bad request") as error:
        main(_token_id_args(fake_server(app), "--model", MODEL_NAME, "--num-prompts", "3",
                            "--input-len", "4", "--output-len", "2"))
    assert "\n" not in str(error.value)
    assert app.state.num_received == 1  # no retry, no timed request


def test_warmups_are_untimed_and_use_their_own_prompts(fake_server):
    app = make_app()
    num_prompts, num_warmups, input_len, vocab = 3, 4, 5, 700
    result = main(parse_bench_args(
        "--base-url", fake_server(app), "--model", MODEL_NAME, "--token-id-prompts",
        "--vocab-size", str(vocab), "--num-prompts", str(num_prompts), "--input-len",
        str(input_len), "--output-len", "2", "--num-warmups", str(num_warmups),
        "--max-concurrency", "2", "--seed", "5"))
    assert result["num_warmups"] == num_warmups
    assert (result["completed"], len(result["latencies"])) == (num_prompts, num_prompts)
    prompts = random_token_prompts(num_prompts + 1 + num_warmups, input_len, vocab, seed=5)
    sent = [p["prompt"] for p in app.state.payloads]
    assert sent[0] == prompts[num_prompts]  # the test prompt
    assert sorted(sent[1:1 + num_warmups]) == sorted(prompts[num_prompts + 1:])
    assert sorted(sent[1 + num_warmups:]) == sorted(prompts[:num_prompts])
    assert app.state.max_in_flight == 2
    assert result["max_concurrent_requests"] == 2


def test_negative_warmups_are_rejected():
    with pytest.raises(ValueError, match="--num-warmups"):
        main(parse_bench_args("--model", MODEL_NAME, "--vocab-size", "500",
                              "--num-warmups", "-1"))


def test_chat_without_usage_counts_chunks_and_honours_max_concurrency(fake_server):
    app = make_app(send_usage=False)
    settings = RequestSettings(api_url=fake_server(app) + CHAT_ENDPOINT, model=MODEL_NAME,
                               output_len=NUM_CHUNKS)
    samples = [SampleRequest("hello there", prompt_len=2) for _ in range(4)]
    records, duration = asyncio.run(benchmark(settings, samples, max_concurrency=2))
    assert [r.success for r in records] == [True] * 4
    # No usage chunk: one token per content chunk; the empty role chunk is not a token.
    assert [r.output_tokens for r in records] == [NUM_CHUNKS] * 4
    assert [r.usage_reported for r in records] == [False] * 4
    assert [len(r.itl) for r in records] == [NUM_CHUNKS - 1] * 4
    assert all(r.ttft >= FIRST_DELAY_S for r in records)
    assert app.state.max_in_flight == 2
    # The second wave waited for a slot.
    assert sorted(r.queue_time for r in records)[-1] >= FIRST_DELAY_S
    # Two waves of two requests, each at least the stream's own duration.
    assert duration >= 2 * (FIRST_DELAY_S + (NUM_CHUNKS - 1) * CHUNK_DELAY_S)
    payload = app.state.payloads[0]
    assert payload["messages"] == [{"role": "user", "content": "hello there"}]
    assert payload["max_completion_tokens"] == payload["max_tokens"] == NUM_CHUNKS
    assert "prompt" not in payload and "ignore_eos" not in payload


def test_without_usage_a_run_counts_output_with_the_tokenizer(fake_server, tokenizer_dir):
    app = make_app(send_usage=False)
    result = main(parse_bench_args(
        "--base-url", fake_server(app), "--backend", "openai-chat", "--tokenizer", tokenizer_dir,
        "--num-prompts", "2", "--random-input-len", "5", "--random-output-len", "3"))
    assert result["endpoint"] == CHAT_ENDPOINT
    # The chunks carry two words each: counted by the tokenizer, not one per chunk.
    assert result["total_output_tokens"] == 2 * NUM_CHUNKS * TOKENS_PER_CHUNK
    assert result["total_input_tokens"] == 2 * 5  # the sampled lengths, without usage


def test_output_that_decodes_to_nothing_arrives_with_its_finish_chunk(fake_server):
    """Every token decoded to '' (special tokens, cut UTF-8), so the server sends no text:
    the finish chunk marks the output's arrival and usage gives its length."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        async def gen():
            await asyncio.sleep(FIRST_DELAY_S)
            for obj in ({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}):
                yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    settings = RequestSettings(api_url=fake_server(app) + "/v1/completions", model=MODEL_NAME)
    (record,), _ = asyncio.run(benchmark(settings, [SampleRequest([1, 2], 2, 3)]))
    assert record.success and (record.output_tokens, record.generated_text) == (3, "")
    assert record.ttft >= FIRST_DELAY_S and record.itl == []
