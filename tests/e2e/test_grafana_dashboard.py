"""docs/grafana.json against a live wide-EP server (two ranks, expert parallelism, EPLB, the
step-time breakdown): after a short load, every series selector of every panel query matches
samples in /metrics, every widellm metric the server exports is on the dashboard, the
request histograms hold exactly the load's numbers, and a client that disconnects mid-stream
counts as request_success_total{finished_reason="abort"}."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server_harness import REQUEST_TIMEOUT_S, ServerProcess

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana.json"
ARCH = "DeepseekV3ForCausalLM"
SERVED_NAME = "tiny-moe"
NUM_ENGINES = 2
# EPLB measures every WINDOW steps and re-plans every INTERVAL (gain 0: every plan applies),
# so a short load sees balancedness, expert loads and weight-move stalls.
WINDOW, INTERVAL, REDUNDANT = 4, 8, 4
SERVER_ARGS = [
    "--served-model-name", SERVED_NAME, "--data-parallel-size", str(NUM_ENGINES),
    "--enable-expert-parallel", "--all2all-backend", "all2all", "--enable-eplb",
    "--eplb-num-redundant-experts", str(REDUNDANT), "--eplb-window-size", str(WINDOW),
    "--eplb-step-interval", str(INTERVAL), "--eplb-min-balancedness-gain", "0",
    "--collect-step-breakdown"]
PROMPT_LENS = (5, 9, 14, 20, 27, 33)
MAX_TOKENS = 8
LONG_MAX_TOKENS = 400  # still generating when the client walks away
IDLE_TIMEOUT_S = 30.0
POLL_S = 0.1
# A series selector: metric name, optionally {matchers}; function calls are followed by "(".
SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
Sample = tuple[str, dict[str, str], float]


def _samples(url: str) -> list[Sample]:
    text = httpx.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def _value(samples: list[Sample], name: str, **labels) -> float:
    return sum(v for n, have, v in samples if n == name and labels.items() <= have.items())


def _selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric, [(label, op, value)]) for each series selector in a PromQL expression."""
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", expr)  # grouping labels
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range durations
    found = []
    for m in SELECTOR.finditer(expr):
        if expr[m.end():].lstrip().startswith("("):
            continue  # a function
        found.append((m.group(1), MATCHER.findall(m.group(2) or "")))
    return found


def _matches(labels: dict[str, str], matchers, variables: dict[str, str]) -> bool:
    for label, op, pattern in matchers:
        for var, value in variables.items():
            pattern = pattern.replace(var, value)
        value = labels.get(label, "")
        hit = re.fullmatch(pattern, value) is not None if "~" in op else value == pattern
        if hit == op.startswith("!"):
            return False
    return True


def _dashboard_exprs() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = ServerProcess(model_dir(ARCH), tmp_path_factory.mktemp("grafana") / "server.log",
                           SERVER_ARGS)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _complete(url: str, prompt_len: int) -> int:
    body = {"model": SERVED_NAME, "prompt": [3 + j % 200 for j in range(prompt_len)],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["completion_tokens"]


def _wait_idle(url: str) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        samples = _samples(url)
        if (_value(samples, "widellm:num_requests_running") == 0
                and _value(samples, "widellm:kv_cache_usage_perc") == 0):
            return
        time.sleep(POLL_S)
    raise AssertionError("the server did not go idle")


def test_every_panel_query_has_data_after_a_short_load(server):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPT_LENS)) as pool:
        assert list(pool.map(lambda n: _complete(server.url, n), PROMPT_LENS)) == [
            MAX_TOKENS] * len(PROMPT_LENS)
    _wait_idle(server.url)
    samples = _samples(server.url)
    # The load's exact numbers, summed over the two engines.
    num = len(PROMPT_LENS)
    assert _value(samples, "widellm:request_prompt_tokens_count") == num
    assert _value(samples, "widellm:request_prompt_tokens_sum") == sum(PROMPT_LENS)
    assert _value(samples, "widellm:prompt_tokens_total") == sum(PROMPT_LENS)
    assert _value(samples, "widellm:request_generation_tokens_sum") == num * MAX_TOKENS
    assert _value(samples, "widellm:request_params_max_tokens_sum") == num * MAX_TOKENS
    assert _value(samples, "widellm:request_params_n_count") == num
    for phase in ("queue", "prefill", "decode", "inference"):
        assert _value(samples, f"widellm:request_{phase}_time_seconds_count") == num
    assert _value(samples, "widellm:request_time_per_output_token_seconds_count") == num
    assert _value(samples, "widellm:inter_token_latency_seconds_count") == num * (MAX_TOKENS - 1)
    assert _value(samples, "widellm:iteration_tokens_total_sum") == (
        sum(PROMPT_LENS) + num * MAX_TOKENS)
    assert _value(samples, "widellm:request_success_total", finished_reason="length") == num
    # Both ranks served requests (the balancer spreads them).
    assert all(_value(samples, "widellm:request_prompt_tokens_count", engine=str(e)) > 0
               for e in range(NUM_ENGINES))

    variables = {"$model_name": SERVED_NAME}
    referenced = set()
    for title, expr in _dashboard_exprs():
        selectors = _selectors(expr)
        assert selectors, (title, expr)
        for name, matchers in selectors:
            referenced.add(name)
            assert any(n == name and _matches(labels, matchers, variables)
                       for n, labels, _ in samples), f"{title}: no data for {name}{matchers}"
    # Every widellm metric the server exports (samples, not just declared) is on the board.
    exported = {n for n, _, _ in samples if n.startswith("widellm:") and
                not n.endswith("_created")}
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in referenced}
    missing = {n for n in exported if n not in referenced
               and re.sub(r"_(bucket|sum|count)$", "", n) not in families}
    assert not missing, missing


def test_client_disconnect_counts_as_abort(server):
    success = "widellm:request_success_total"
    before = _samples(server.url)
    body = {"model": SERVED_NAME, "prompt": [7] * 12, "max_tokens": LONG_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as response:
        assert next(response.iter_lines()).startswith("data: {")
    _wait_idle(server.url)
    after = _samples(server.url)
    delta = {reason: _value(after, success, finished_reason=reason)
             - _value(before, success, finished_reason=reason)
             for reason in ("stop", "length", "abort", "error")}
    assert delta == {"stop": 0, "length": 0, "abort": 1, "error": 0}
    # Counted on the rank that held it, never on the "not routed" label.
    assert _value(after, success, finished_reason="abort", engine="none") == 0
    generated = (_value(after, "widellm:generation_tokens_total")
                 - _value(before, "widellm:generation_tokens_total"))
    assert 0 < generated < LONG_MAX_TOKENS
