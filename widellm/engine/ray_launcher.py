"""``--data-parallel-backend ray``: the data-parallel ranks as Ray actors on the nodes of an
existing Ray cluster, instead of processes started on this machine (``mp``).

Only the way a rank's process comes to exist changes: each actor runs the mp launcher's
process main (``core_proc.run_engine_core``), so handshake, torch.distributed groups, lockstep
and EPLB are the ones of the mp launcher. The frontend listens on TCP at this node's address
as Ray knows it (loopback is unreachable from other nodes), and hosts the rendezvous store
there, as it does for ``--headless`` ranks.

Ray is imported here only, and this module only when the backend is ``ray``. The cluster must
exist (``ray start --head``, or ``RAY_ADDRESS``): without one, Ray would quietly start a
private single-node cluster, and the user who asked for ranks across machines would get them
all on this one.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import signal
import threading

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup, placement_group, placement_group_table, remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from widellm.config import EngineConfig
from widellm.engine.core_proc import run_engine_core
from widellm.engine.kv_budget import share_host_memory
from widellm.engine.ray_placement import (
    RankPlacement, cpus_per_rank, forwarded_env, missing_resources, place_ranks, rank_bundles,
)

logger = logging.getLogger(__name__)

# PACK fills a node before the next: ranks that share a node exchange their all-to-all
# traffic locally, and fewer node boundaries sit inside the EP group.
PLACEMENT_STRATEGY = "PACK"
# Variables a local rank would inherit from the frontend and a Ray worker would not.
FORWARDED_ENV_PREFIXES = ("WIDELLM_", "GLOO_", "NCCL_", "TORCH_EXTENSIONS_DIR", "HF_",
                          "TRITON_")
# An exit status for a rank whose actor died or whose main raised (multiprocessing's 0 means
# the main returned, as after a SHUTDOWN or a reported engine error).
ACTOR_FAILED_EXITCODE = 1
NO_CLUSTER_HINT = ("--data-parallel-backend ray needs a running Ray cluster: start one with "
                   "`ray start --head` on this node (`ray start --address HEAD_IP:6379` on the "
                   "others), or point RAY_ADDRESS at it")


class EngineCoreActor:
    """One data-parallel rank inside a Ray actor."""

    def describe(self) -> tuple[int, str]:
        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, config: EngineConfig, handshake_addr: str, dp_rank: int) -> None:
        if config.device != "cuda":
            # The GEMMs' threads are the CPUs Ray reserved for this rank, not the node's.
            cpus = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))
            torch.set_num_threads(max(1, cpus))
        # This node's memory, read here: the frontend's node may be another machine.
        # The actor's parent is Ray's raylet: a rank outlives neither it nor (Ray kills the
        # actors of a driver that is gone) the frontend.
        run_engine_core(share_host_memory(config), handshake_addr, dp_rank)


class RayRankHandle:
    """A rank in a Ray actor, seen through the part of ``multiprocessing.Process`` the engine
    client reads (``name``, ``pid``, ``is_alive()``, ``exitcode``)."""

    def __init__(self, rank: int, pid: int, node_ip: str, run_ref: ray.ObjectRef) -> None:
        self.name = f"widellm-engine-core-{rank} (Ray actor on {node_ip})"
        self.pid = pid
        self._ref = run_ref
        self._exitcode: int | None = None
        self.exit_reason: str | None = None  # in words, for a rank that failed

    def is_alive(self) -> bool:
        if self._exitcode is None:
            ready, _ = ray.wait([self._ref], timeout=0)
            if ready:
                self._exitcode = self._outcome()
        return self._exitcode is None

    @property
    def exitcode(self) -> int | None:
        self.is_alive()
        return self._exitcode

    def _outcome(self) -> int:
        try:
            ray.get(self._ref)
            return 0
        except Exception as e:  # the actor died (killed, OOM, node lost) or its main raised
            logger.error("%s failed: %s", self.name, e)
            summary = str(e).strip().splitlines()
            self.exit_reason = f"{type(e).__name__}: {summary[0] if summary else ''}"
            return ACTOR_FAILED_EXITCODE


def connect_ray() -> None:
    """Join the running cluster, unless this process already has. The connection stays after
    shutdown: another engine of this process may be using it, and the actors of a driver that
    disconnects die with it."""
    if ray.is_initialized():
        return
    # ray.init replaces SIGTERM's handler with a bare exit; the server's own (graceful
    # shutdown, engine cores stopped on the way out) must stay in charge.
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto")
    except ConnectionError as e:
        raise RuntimeError(f"{NO_CLUSTER_HINT} ({e})") from None
    finally:
        if main_thread and sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


class RayLauncher:
    """Places the ranks, starts them, and removes every actor and the placement group."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        if pc.data_parallel_size_local is not None or pc.data_parallel_start_rank != 0:
            raise ValueError("--data-parallel-backend ray places every rank itself: leave out "
                             "--data-parallel-size-local and --data-parallel-start-rank")
        self._config = config
        connect_ray()
        # Where the ranks reach the frontend: an address given that other nodes can reach,
        # else this node's address in the cluster.
        self.frontend_host = (ray.util.get_node_ip_address()
                              if _is_loopback(pc.data_parallel_address)
                              else pc.data_parallel_address)
        self._pg: PlacementGroup | None = None
        self._actors: list = []
        self._refs: list[ray.ObjectRef] = []

    def start(self, handshake_addr: str) -> list[RayRankHandle]:
        """Reserve one bundle per rank, then start every rank's actor."""
        pc = self._config.parallel_config
        bundles = rank_bundles(pc.data_parallel_size, self._config.device == "cuda",
                               cpus_per_rank(os.environ))
        missing = missing_resources(bundles, ray.cluster_resources())
        if missing:
            short = ", ".join(f"{name}: {need:g} needed, {have:g} in the cluster"
                              for name, (need, have) in missing.items())
            raise RuntimeError(f"the Ray cluster is too small for {len(bundles)} ranks "
                               f"({bundles[0]} each): {short}")
        self._pg = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        try:
            ray.get(self._pg.ready(), timeout=pc.engine_ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray could not reserve {len(bundles)} x {bundles[0]} within "
                               f"{pc.engine_ready_timeout_s:.0f} s (busy cluster?)") from None
        table = placement_group_table(self._pg)["bundles_to_node_id"]
        placements = place_ranks([table[i] for i in range(len(bundles))],
                                 ray.get_runtime_context().get_node_id())
        actor_cls = ray.remote(EngineCoreActor)
        env = forwarded_env(os.environ, FORWARDED_ENV_PREFIXES)
        for p in placements:
            bundle = bundles[p.bundle_index]
            self._actors.append(actor_cls.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=p.bundle_index),
                runtime_env={"env_vars": env} if env else None,
            ).remote())
        described = ray.get([a.describe.remote() for a in self._actors],
                            timeout=pc.engine_ready_timeout_s)
        handles = []
        for p, actor, (pid, node_ip) in zip(placements, self._actors, described):
            ref = actor.run.remote(self._rank_config(p), handshake_addr, p.rank)
            self._refs.append(ref)
            handles.append(RayRankHandle(p.rank, pid, node_ip, ref))
        logger.info("Ray: %d ranks on %d node(s) (%s)", len(placements),
                    len({p.node_id for p in placements}),
                    ", ".join(f"rank {p.rank}: {ip}" for p, (_, ip) in zip(placements, described)))
        return handles

    def _rank_config(self, p: RankPlacement) -> EngineConfig:
        """The config a rank gets: its node's ranks as the node-local ones."""
        pc = self._config.parallel_config
        return self._config.replace(parallel_config=dataclasses.replace(
            pc, data_parallel_size_local=p.node_num_ranks,
            data_parallel_start_rank=p.node_start_rank))

    def stop(self, grace_s: float) -> None:
        """Give the ranks ``grace_s`` to finish after the frontend's SHUTDOWN, then remove
        every actor (one whose main returned still holds its bundle) and the reservation."""
        if self._refs:
            ray.wait(self._refs, num_returns=len(self._refs), timeout=grace_s)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # already gone: nothing to free
                logger.debug("ray.kill: %s", e)
        self._actors, self._refs = [], []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _is_loopback(host: str) -> bool:
    """Whether ``host`` is no address another node can connect to (loopback, or 0.0.0.0)."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name: taken as given
    return ip.is_loopback or ip.is_unspecified
