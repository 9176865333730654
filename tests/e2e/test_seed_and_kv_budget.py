"""``--seed`` reaches every engine core, and the local ranks of one host share one KV budget.

Seeds: fresh servers (and fresh DP2 servers, with a request pinned to each rank by the
X-data-parallel-rank header) started with the same --seed give the same unseeded
temperature-1 text; another seed, or another rank, gives other text. KV budget: at DP2 and
DP4 the KV pools the ranks log add up to the one budget the launcher logs (fraction x the
host's MemAvailable, read once), chosen small enough that the budget, not max_num_seqs x
max_model_len, sizes the pools.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_harness import PROMPT, ServerProcess
from widellm.engine.llm import LLM
from widellm.entrypoints.serving_base import DATA_PARALLEL_RANK_HEADER
from widellm.sampling_params import SamplingParams

MODEL_ARCH = "LlamaForCausalLM"
# Random weights at temperature 1 draw nearly uniformly from the tokenizer's vocabulary
# (tens of thousands of tokens): two unrelated streams share a 48-token text with
# probability far below 1e-100.
MAX_TOKENS = 48
SAMPLED = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
REQUEST_TIMEOUT_S = 60.0
SUBPROCESS_TIMEOUT_S = 300.0
MAX_MODEL_LEN = 512
DP_ENGINE_KWARGS = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN,
                    "max_num_batched_tokens": 256, "num_kv_blocks": 128}


def _sampled_text(server: ServerProcess, rank: int | None = None) -> str:
    body = {"model": server.model_name, "prompt": PROMPT, **SAMPLED}
    headers = {} if rank is None else {DATA_PARALLEL_RANK_HEADER: str(rank)}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers,
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _texts_of_fresh_servers(model_dir, tmp_path, seeds: dict[str, int], dp: int
                            ) -> dict[str, list[str]]:
    """Fresh servers, one per name, started with ``--seed seeds[name]`` all at once (they are
    separate processes; suite time). At DP1: two sampled texts in a row from each; at DP2:
    one text from each rank, pinned by the rank header."""
    servers = {}
    try:
        for name, seed in seeds.items():
            args = ["--seed", str(seed)] + (["--data-parallel-size", str(dp)] if dp > 1 else [])
            servers[name] = ServerProcess(model_dir(MODEL_ARCH), tmp_path / f"{name}.log", args)
            servers[name].model_name = model_dir(MODEL_ARCH)
        texts = {}
        for name, server in servers.items():
            server.wait_ready()
            texts[name] = ([_sampled_text(server), _sampled_text(server)] if dp == 1 else
                           [_sampled_text(server, rank) for rank in range(dp)])
        return texts
    finally:
        for server in servers.values():
            server.stop()


SEEDS = {"seed7a": 7, "seed7b": 7, "seed8": 8}


@pytest.mark.timeout(600)
def test_fresh_servers_with_one_seed_sample_the_same_text(model_dir, tmp_path):
    texts = _texts_of_fresh_servers(model_dir, tmp_path, SEEDS, dp=1)
    first, again, other = texts["seed7a"], texts["seed7b"], texts["seed8"]
    assert first == again
    assert first[0] != first[1]  # the stream moves on: a second request draws new noise
    assert other[0] != first[0] and other[1] != first[1]


@pytest.mark.timeout(600)
def test_dp2_ranks_draw_distinct_reproducible_streams(model_dir, tmp_path):
    texts = _texts_of_fresh_servers(model_dir, tmp_path, SEEDS, dp=2)
    first, again, other = texts["seed7a"], texts["seed7b"], texts["seed8"]
    assert first == again
    assert first[0] != first[1]  # rank 0 and rank 1 do not share a stream
    assert other[0] != first[0] and other[1] != first[1]


@pytest.mark.timeout(600)
def test_offline_dp2_ranks_follow_the_seed(model_dir):
    """``LLM(seed=...)`` seeds every rank of an offline deployment the same way."""
    params = SamplingParams(**SAMPLED)
    texts = []
    for _ in range(2):
        llm = LLM(model_dir(MODEL_ARCH), seed=7, data_parallel_size=2, **DP_ENGINE_KWARGS)
        try:
            outs = llm.generate([PROMPT, PROMPT], [params, params], data_parallel_rank=[0, 1])
            texts.append([o.outputs[0].text for o in outs])
        finally:
            llm.shutdown()
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1]


# ---- one KV budget per host --------------------------------------------------------------------

HOST_BUDGET = re.compile(r"KV budget: (\d+) bytes available x kv_cache_memory_fraction (\S+) = "
                         r"(\d+) bytes for the KV caches of this host, shared by (\d+) local")
RANK_POOL = re.compile(r"core(\d+): KV cache: (\d+) blocks x \d+ tokens = \d+ tokens, "
                       r"[\d.]+ GiB = (\d+) bytes \((\d+) bytes per block; "
                       r"sized by this rank's (\d+)-byte budget")
# The host budget the test aims at: 256 llama-tiny fp32 blocks (16 KiB each) per rank at DP4,
# far below the 256 x 32 blocks max_num_seqs x max_model_len would use, and far above the
# 32 blocks a max_model_len request needs, so MemAvailable may drift 2x either way.
TARGET_HOST_BUDGET = 16 << 20
_LAUNCH = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s frontend: %(message)s")
from widellm.engine.llm import LLM
from widellm.entrypoints.serving_base import DATA_PARALLEL_RANK_HEADER
llm = LLM(sys.argv[1], data_parallel_size=int(sys.argv[2]), kv_cache_memory_fraction=float(
    sys.argv[3]), dtype="float32", max_model_len=512, max_num_batched_tokens=256)
llm.shutdown()
"""


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dp", [2, 4])
def test_local_ranks_split_one_host_kv_budget(model_dir, dp):
    fraction = TARGET_HOST_BUDGET / _mem_available()
    proc = subprocess.run([sys.executable, "-c", _LAUNCH, model_dir(MODEL_ARCH), str(dp),
                           repr(fraction)], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    hosts = HOST_BUDGET.findall(log)
    assert len(hosts) == 1, log  # measured once, by the launcher
    available, logged_fraction, budget, local = hosts[0]
    assert int(local) == dp and float(logged_fraction) == pytest.approx(fraction)
    budget = int(budget)
    assert budget == int(int(available) * float(logged_fraction))
    pools = {int(rank): (int(blocks), int(nbytes), int(per_block), int(rank_budget))
             for rank, blocks, nbytes, per_block, rank_budget in RANK_POOL.findall(log)}
    assert sorted(pools) == list(range(dp)), log
    for blocks, nbytes, per_block, rank_budget in pools.values():
        assert rank_budget == budget // dp
        assert blocks == rank_budget // per_block and nbytes == blocks * per_block
    total = sum(nbytes for _, nbytes, _, _ in pools.values())
    # The ranks together hold one budget (less each rank's rounding to whole blocks).
    per_block = next(iter(pools.values()))[2]
    assert budget - dp * per_block < total <= budget
