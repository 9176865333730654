"""Disaggregated prefill/decode through ``widellm proxy``: one prefill instance (kv_producer)
and one decode instance (kv_consumer), each its own ``widellm serve`` process joined by the
TCP connector, give the greedy fp32 outputs of one colocated engine, token for token, for a
tiny Llama and a tiny DeepSeek-V3 (MLA: the compressed latent moves), streamed and not, with
prefix-cache hits on both sides; the same with a decode pool at DP2 + EP2; and 32 concurrent
requests from the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.e2e import disagg_utils
from tests.e2e.disagg_utils import ProxyProcess, kv_flags, kv_usage, started, wait_for_metric
from tests.e2e.server_harness import REQUEST_TIMEOUT_S, ServerProcess, metric, metrics
from widellm import LLM, SamplingParams

MAX_TOKENS = 10
# Prompts of 5..229 tokens: under, at and over block boundaries (block size 16).
PROMPTS = [[3 + (11 * i + j) % 240 for j in range(5 + 28 * i)] for i in range(9)]
EP_FLAGS = ["--data-parallel-size", "2", "--enable-expert-parallel"]
NUM_CONCURRENT = 32
BLOCK_SIZE = 16
# Round 2 loads a prompt again unless its first len - 1 tokens are whole blocks, which the
# decode side then has cached from round 1 (it tells the prefill side to let go instead).
NUM_LOADS = len(PROMPTS) + sum((len(p) - 1) % BLOCK_SIZE != 0 for p in PROMPTS)
# The streamed flow's prompts: new to both instances after the sequential tests ran.
STREAMED_PROMPTS = [[t + 1 for t in p] for p in PROMPTS]
STREAMED = ["--kv-transfer-mode", "streamed"]
LEASE_S = 30.0  # the TCP connector's default lease_s (kv_flags sets none)


def _reference(path: str, prompts: list[list[int]]) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", num_kv_blocks=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _complete(url: str, prompt: list[int], stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        return r.json()["choices"][0]["text"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)
    chunks = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.fixture(scope="module")
def llama_deployment(model_dir, tmp_path_factory):
    """Prefill + decode instances of the tiny Llama behind a proxy of each flow."""
    model, tmp = model_dir("LlamaForCausalLM"), tmp_path_factory.mktemp("llama")
    prefill = ServerProcess(model, tmp / "prefill.log", kv_flags("kv_producer"))
    decode = ServerProcess(model, tmp / "decode.log", kv_flags("kv_consumer"))
    with started(prefill, decode):
        with started(ProxyProcess([prefill.url], [decode.url], tmp / "proxy.log"),
                     ProxyProcess([prefill.url], [decode.url], tmp / "proxy-streamed.log",
                                  STREAMED)) as (proxy, streamed):
            yield model, prefill, decode, proxy, streamed


@pytest.fixture(scope="module")
def llama(llama_deployment):
    return llama_deployment[:4]


@pytest.fixture(scope="module")
def deepseek(model_dir, tmp_path_factory):
    """One prefill instance of the tiny DeepSeek-V3 feeding two decode pools, one at DP1 and
    one at DP2 + EP2, each behind its own proxy."""
    model, tmp = model_dir("DeepseekV3ForCausalLM"), tmp_path_factory.mktemp("deepseek")
    prefill = ServerProcess(model, tmp / "prefill.log", kv_flags("kv_producer"))
    dp1 = ServerProcess(model, tmp / "decode-dp1.log", kv_flags("kv_consumer"))
    dp2 = ServerProcess(model, tmp / "decode-dp2.log", [*kv_flags("kv_consumer"), *EP_FLAGS])
    with started(prefill, dp1, dp2):
        with started(ProxyProcess([prefill.url], [dp1.url], tmp / "proxy-dp1.log"),
                     ProxyProcess([prefill.url], [dp2.url], tmp / "proxy-dp2.log"),
                     ProxyProcess([prefill.url], [dp2.url], tmp / "proxy-dp2-streamed.log",
                                  STREAMED)) as proxies:
            yield model, prefill, {1: (dp1, proxies[0]), 2: (dp2, proxies[1]),
                                   "streamed": (dp2, proxies[2])}


def _sent(server: ServerProcess) -> float:
    return metric(metrics(server), "widellm:kv_transfers_total", direction="send")


def _check_through_proxy(model: str, prefill: ServerProcess, decode: ServerProcess,
                         proxy: ServerProcess, ranks: int = 1,
                         prompts: list[list[int]] = PROMPTS) -> None:
    expected = _reference(model, prompts)
    sent_before = _sent(prefill)
    loads_before = metric(metrics(decode), "widellm:kv_transfers_total", direction="recv")
    # Round 1 loads every prompt's KV (the prefill side computes it, or hits its own cache);
    # round 2 (streamed) hits the decode side's prefix cache too: it loads only what it lacks.
    assert [_complete(proxy.url, p, stream=False) for p in prompts] == expected
    assert [_complete(proxy.url, p, stream=True) for p in prompts] == expected
    for server in (prefill, decode):
        values = metrics(server)
        assert metric(values, "widellm:prefix_cache_hits_total") > 0, server.log_path
    values = metrics(decode)
    # Every request loaded its prompt's KV; none was recomputed or failed.
    loads = metric(values, "widellm:kv_transfers_total", direction="recv")
    assert loads - loads_before == NUM_LOADS
    assert metric(values, "widellm:kv_transfer_recomputed_total") == 0
    assert metric(values, "widellm:kv_transfer_failures_total") == 0
    assert metric(values, "widellm:kv_transfer_bytes_total", direction="recv") > 0
    for rank in map(str, range(ranks)):  # every decode rank got requests and loaded them
        assert metric(values, "widellm:kv_transfers_total", direction="recv", engine=rank) > 0
    wait_for_metric(prefill, "widellm:kv_transfers_total",
                    lambda v: v == sent_before + NUM_LOADS, direction="send")
    # Every held block went back once its decode pulled it or let it go.
    wait_for_metric(prefill, "widellm:kv_transfer_blocks_held", lambda v: v == 0)
    assert kv_usage(prefill) == 0 and kv_usage(decode) == 0


def test_llama_through_proxy(llama):
    _check_through_proxy(*llama)


def test_deepseek_mla_through_proxy(deepseek):
    model, prefill, pools = deepseek
    _check_through_proxy(model, prefill, *pools[1])


def test_deepseek_decode_pool_dp2_ep2(deepseek):
    """Prefill at DP1, decode at DP2 + EP2: each request's blocks go to the decode rank the
    decode instance's balancer picked."""
    model, prefill, pools = deepseek
    _check_through_proxy(model, prefill, *pools[2], ranks=2)


def _streamed_transfers(proxy: ServerProcess) -> float:
    return metric(metrics(proxy), "widellm:proxy_streamed_transfers_total")


def test_llama_through_streamed_proxy(llama_deployment):
    """Prefill and decode sent at once: the decode instance pulls each layer while the
    prefill instance still computes the prompt; same tokens, same loads, nothing held."""
    model, prefill, decode, _, streamed = llama_deployment
    _check_through_proxy(model, prefill, decode, streamed, prompts=STREAMED_PROMPTS)
    assert _streamed_transfers(streamed) == 2 * len(STREAMED_PROMPTS)


def test_deepseek_mla_dp2_ep2_through_streamed_proxy(deepseek):
    model, prefill, pools = deepseek
    _check_through_proxy(model, prefill, *pools["streamed"], ranks=2, prompts=STREAMED_PROMPTS)
    assert _streamed_transfers(pools["streamed"][1]) == 2 * len(STREAMED_PROMPTS)


def test_openai_client_32_concurrent_and_chat(llama):
    model, prefill, decode, proxy = llama
    prompts = [PROMPTS[i % len(PROMPTS)] + [7 + i] for i in range(NUM_CONCURRENT)]
    expected = _reference(model, prompts)
    loads_before = metric(metrics(decode), "widellm:kv_transfers_total", direction="recv")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)
    name = client.models.list().data[0].id

    def one(prompt: list[int]) -> str:
        return client.completions.create(
            model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        assert list(pool.map(one, prompts)) == expected
    # Chat through the proxy equals chat on the decode instance alone (which then computes
    # the prompt itself), streamed and not.
    messages = [{"role": "user", "content": "Say something about disaggregation."}]
    direct = openai.OpenAI(base_url=decode.url + "/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)
    kwargs = dict(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    want = direct.chat.completions.create(**kwargs).choices[0].message.content
    got = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kwargs, stream=True) if c.choices)
    assert got == want and streamed == want
    # Each of the 32 prompts loaded its KV (its last token is new to the decode side), and
    # both chat requests did: the direct one computed it locally, so its blocks were cached,
    # but a prompt whose len - 1 tokens are not whole blocks still loads the partial block.
    loads = metric(metrics(decode), "widellm:kv_transfers_total", direction="recv")
    assert loads - loads_before == NUM_CONCURRENT + 2
    wait_for_metric(prefill, "widellm:kv_transfer_blocks_held", lambda v: v == 0)
    assert kv_usage(prefill) == 0 and kv_usage(decode) == 0


REFUSALS = {  # requests the decode instance refuses (400) that the prefill instance does not
    "max_tokens": {"max_tokens": -1},
    # Refused by the engine's KV check, which runs before a stream starts: a 400, not an
    # error inside a 200 stream that no router would read as a refusal.
    "stream_n2": {"max_tokens": 4, "stream": True, "n": 2},
}


REFUSAL_CASES = [("sequential", "max_tokens"), ("streamed", "max_tokens"),
                 ("direct", "max_tokens"), ("direct", "stream_n2")]


@pytest.mark.parametrize("flow,refusal", REFUSAL_CASES)
def test_a_request_the_decode_refuses_leaves_no_blocks_held(llama_deployment, flow, refusal):
    """A request that passes the prefill (asked for one token, alone) and is refused by the
    decode instance (400): the prefill's blocks are released at once instead of being left held
    for the 30 s lease (the poll below gives up at half of it). Through the proxy, by the proxy
    (and the decode instance); called directly, as another router would, by the decode
    instance's server."""
    _, prefill, decode, proxy, streamed = llama_deployment
    # New to both instances (and to the other cases' runs).
    prompt = [t + 5 + REFUSAL_CASES.index((flow, refusal)) for t in PROMPTS[4]]
    released_before = metric(metrics(decode), "widellm:refused_prefill_releases_total",
                             outcome="released")
    body = {"prompt": prompt, **REFUSALS[refusal]}
    if flow == "direct":
        params = disagg_utils.prefill(prefill, prompt)
        wait_for_metric(prefill, "widellm:kv_transfer_blocks_held", lambda v: v > 0)
        r = httpx.post(decode.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                       json={**body, "kv_transfer_params": params})
    else:
        r = httpx.post((proxy if flow == "sequential" else streamed).url + "/v1/completions",
                       timeout=REQUEST_TIMEOUT_S, json=body)
        wait_for_metric(proxy if flow == "sequential" else streamed,
                        "widellm:proxy_prefill_releases_total", lambda v: v == 1,
                        outcome="released")
    assert r.status_code == 400, r.text
    wait_for_metric(prefill, "widellm:kv_transfer_blocks_held", lambda v: v == 0,
                    timeout_s=LEASE_S / 2)
    assert kv_usage(prefill) == 0
    wait_for_metric(decode, "widellm:refused_prefill_releases_total",
                    lambda v: v == released_before + 1, outcome="released")
