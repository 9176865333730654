"""Where the Ray launcher puts each data-parallel rank: pure functions, no Ray import, so the
placement rules are testable on any checkout.

One placement-group bundle per rank: ``{"GPU": 1, "CPU": 1}`` on GPU (the CPU for the core's
own Python thread), ``{"CPU": cpus_per_rank}`` on CPU. After Ray has placed the bundles, ranks
are numbered node by node, the frontend's node first: the ranks of one node are then
consecutive, as with ``--data-parallel-size-local`` / ``--data-parallel-start-rank`` by hand,
which is what the per-node CPU memory share and EPLB's node count assume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Each GPU rank's engine core also needs a CPU slot for its scheduler and Python loop.
CPUS_PER_GPU_RANK = 1
# Environment variable: CPUs each rank of a CPU engine reserves (its bundle, and the threads
# of its GEMMs). Default: DEFAULT_CPUS_PER_RANK.
CPUS_PER_RANK_ENV = "WIDELLM_RAY_CPUS_PER_RANK"
DEFAULT_CPUS_PER_RANK = 1


def cpus_per_rank(environ: Mapping[str, str]) -> int:
    """The CPU count of a CPU rank's bundle, from :data:`CPUS_PER_RANK_ENV`."""
    raw = environ.get(CPUS_PER_RANK_ENV) or str(DEFAULT_CPUS_PER_RANK)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{CPUS_PER_RANK_ENV} must be a whole number, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{CPUS_PER_RANK_ENV} must be >= 1, got {value}")
    return value


def rank_bundles(num_ranks: int, on_gpu: bool, cpus: int) -> list[dict[str, float]]:
    """One placement-group bundle per rank."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    bundle = ({"GPU": 1.0, "CPU": float(CPUS_PER_GPU_RANK)} if on_gpu
              else {"CPU": float(cpus)})
    return [dict(bundle) for _ in range(num_ranks)]


def missing_resources(bundles: Sequence[Mapping[str, float]],
                      cluster: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """Resources the whole cluster has too little of for ``bundles``: name -> (needed, total).
    Empty when the bundles may fit (they may still wait for busy resources to free up)."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    return {name: (amount, cluster.get(name, 0.0)) for name, amount in needed.items()
            if cluster.get(name, 0.0) < amount}


@dataclass(frozen=True, slots=True)
class RankPlacement:
    rank: int
    bundle_index: int
    node_id: str
    # This rank's node as a ParallelConfig sees it: its first rank and how many it runs.
    node_start_rank: int
    node_num_ranks: int


def place_ranks(bundle_nodes: Sequence[str], frontend_node: str) -> list[RankPlacement]:
    """Rank r -> bundle, from the node each bundle landed on (``bundle_nodes[i]``: bundle i's
    node id). Nodes in order of first appearance, the frontend's node first (rank 0 next to
    the frontend, like the mp launcher); ranks consecutive within a node.

    When the nodes hold different numbers of ranks, every rank is told it shares one node with
    all the others: EPLB's node count (data_parallel_size // ranks per node) must be the same
    on every rank, and a smaller per-rank CPU memory share is safe where a larger is not."""
    nodes: list[str] = []
    for node in bundle_nodes:
        if node not in nodes:
            nodes.append(node)
    if frontend_node in nodes:
        nodes.remove(frontend_node)
        nodes.insert(0, frontend_node)
    by_node = {node: [i for i, n in enumerate(bundle_nodes) if n == node] for node in nodes}
    even = len({len(b) for b in by_node.values()}) == 1
    placements, rank = [], 0
    for node in nodes:
        start = rank if even else 0
        count = len(by_node[node]) if even else len(bundle_nodes)
        for bundle_index in by_node[node]:
            placements.append(RankPlacement(rank, bundle_index, node, start, count))
            rank += 1
    return placements


def forwarded_env(environ: Mapping[str, str], prefixes: Sequence[str]) -> dict[str, str]:
    """The frontend's variables a rank should see as if it were a local child process (Ray
    workers inherit the environment of ``ray start``, not of the frontend)."""
    return {k: v for k, v in environ.items() if k.startswith(tuple(prefixes))}
