"""Helpers shared by the ``widellm bench serve`` tests: an in-thread uvicorn server on a
free port, and a word-level tokenizer whose token i is the word ``t{i}``."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from widellm.bench.serve_args import add_cli_args

SERVER_START_TIMEOUT_S = 10.0
POLL_S = 0.01


def bound_socket() -> socket.socket:
    """A socket on a free 127.0.0.1 port, handed to uvicorn so no other process can take
    the port between choosing and listening (and, never listened on, one that refuses)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serve_app(app: FastAPI, sock: socket.socket | None = None):
    """Run ``app`` in a background thread (on ``sock`` if given); yield its base URL; always
    stop the thread."""
    sock = sock or bound_socket()
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


def word_level_tokenizer(path, vocab_size: int) -> None:
    """Save a tokenizer folder at ``path`` whose token i is the word ``t{i}`` (unknown words
    are ``t0``): decoded text is checkable and every word is exactly one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


def parse_bench_args(*argv: str) -> argparse.Namespace:
    """``widellm bench serve``'s flags parsed from ``argv`` (progress bar off)."""
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([*argv, "--disable-tqdm"])
