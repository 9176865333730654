"""A live server's flow while a test abuses it: ``/health`` polled and one streaming completion
always running, each in its own thread; each test reads the slowest health answer and the
longest wait for a stream chunk over the window in which it sent its input."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import httpx

from tests.e2e.server_harness import PROMPT

# The freezes these catch last seconds (tokenizing a 4 MiB body on the event loop: over 4 s);
# the budgets leave room for the ~1.3 s stalls a 2-core CI box gives a poll now and then.
HEALTH_BUDGET_S = 2.0
STREAM_GAP_BUDGET_S = 3.0
# How long each window stays open after its request, so a stall it caused would be seen.
WINDOW_TAIL_S = 0.3
HEALTH_POLL_S = 0.05
CLIENT_TIMEOUT_S = 60.0
STREAM_MAX_TOKENS = 400  # a few seconds per stream, well inside the test server's max_model_len
COMPLETIONS = "/v1/completions"


@dataclass
class Window:
    max_health_s: float = 0.0
    max_gap_s: float = 0.0
    health_answers: int = 0
    chunks: int = 0

    def assert_flowing(self) -> None:
        assert self.health_answers >= 1 and self.chunks >= 1, self
        assert self.max_health_s < HEALTH_BUDGET_S, self
        assert self.max_gap_s < STREAM_GAP_BUDGET_S, self


class FlowMonitor:
    """/health polled and one streaming completion always running (the next one starts as
    each ends), each in its own thread; ``window()`` reports the slowest health answer and
    the longest wait for a stream chunk (the first chunk of each stream included)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.window_state = Window()
        self.health_since: float | None = None  # start of the poll in flight
        self.last_chunk = time.monotonic()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._recording, args=(work,), daemon=True)
                        for work in (self._poll_health, self._stream)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(CLIENT_TIMEOUT_S)

    def _recording(self, work) -> None:
        try:
            work()
        except Exception as e:  # a failed poll or stream fails the next window
            with self.lock:
                self.errors.append(f"{work.__name__}: {e!r}")

    def _poll_health(self) -> None:
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
            while not self.stopping.is_set():
                start = time.monotonic()
                with self.lock:
                    self.health_since = start
                status = client.get(self.url + "/health").status_code
                with self.lock:
                    self.health_since = None
                    w = self.window_state
                    w.max_health_s = max(w.max_health_s, time.monotonic() - start)
                    w.health_answers += 1
                    if status != 200:
                        self.errors.append(f"/health answered {status}")
                time.sleep(HEALTH_POLL_S)

    def _chunk(self) -> None:
        now = time.monotonic()
        with self.lock:
            w = self.window_state
            w.max_gap_s = max(w.max_gap_s, now - self.last_chunk)
            w.chunks += 1
            self.last_chunk = now

    def _stream(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": STREAM_MAX_TOKENS, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
            while not self.stopping.is_set():
                with client.stream("POST", self.url + COMPLETIONS, json=body) as response:
                    if response.status_code != 200:
                        self.errors.append(f"stream answered {response.status_code}")
                        return
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            self._chunk()
                        if self.stopping.is_set():
                            return

    @contextlib.contextmanager
    def window(self):
        with self.lock:
            self.window_state = Window()
            window = self.window_state
        yield window
        time.sleep(WINDOW_TAIL_S)
        now = time.monotonic()
        with self.lock:  # waits still under way count too
            window.max_gap_s = max(window.max_gap_s, now - self.last_chunk)
            if self.health_since is not None:
                window.max_health_s = max(window.max_health_s, now - self.health_since)
            assert not self.errors, self.errors
