"""Host memory the KV budget may take: MemAvailable, lowered by memory cgroup limits
(worker/host_memory.py). Fake /proc and /sys trees give exact answers; one test puts a real
process in a real child cgroup where this machine lets it make one."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from widellm.worker.host_memory import (
    AvailableMemory, ProcFiles, cgroup_dirs, host_available_memory,
)

GIB = 1 << 30
MEMINFO = "MemTotal:       32000000 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB available
V2_MOUNTS = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
             "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
V1_UNLIMITED = "9223372036854771712"
SUBPROCESS_TIMEOUT_S = 120


def _tree(root: Path, cgroup: str, mountinfo: str, folders: dict[str, dict[str, str]]):
    proc = root / "proc" / "self"
    proc.mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(MEMINFO)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    for folder, files in folders.items():
        path = root / folder.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (path / name).write_text(text)
    return ProcFiles(root=root)


def _v2(limit: str, current: int, inactive: int) -> dict[str, str]:
    return {"memory.max": limit + "\n", "memory.current": f"{current}\n",
            "memory.stat": f"anon 1\ninactive_file {inactive}\nactive_file 7\n"}


def test_v2_limit_less_reclaimable_page_cache(tmp_path):
    """The module docstring's example: 8 GiB limit, 3 GiB used of which 1 GiB inactive file."""
    files = _tree(tmp_path, "0::/kubepods/pod1\n", V2_MOUNTS, {
        "/sys/fs/cgroup": _v2("max", 9 * GIB, 0),
        "/sys/fs/cgroup/kubepods": _v2("max", 5 * GIB, 0),
        "/sys/fs/cgroup/kubepods/pod1": _v2(str(8 * GIB), 3 * GIB, GIB),
    })
    top = tmp_path / "sys/fs/cgroup"
    assert cgroup_dirs(files) == (2, [top / "kubepods/pod1", top / "kubepods", top])
    assert host_available_memory(files) == AvailableMemory(
        6 * GIB, f"cgroup v2 {top / 'kubepods/pod1'}")


def test_v2_tighter_parent_wins_and_no_limit_leaves_mem_available(tmp_path):
    files = _tree(tmp_path / "a", "0::/slice/leaf\n", V2_MOUNTS, {
        "/sys/fs/cgroup/slice": _v2(str(4 * GIB), 3 * GIB, 0),
        "/sys/fs/cgroup/slice/leaf": _v2(str(8 * GIB), 2 * GIB, 0),
    })
    assert host_available_memory(files).num_bytes == GIB
    free = _tree(tmp_path / "b", "0::/slice\n", V2_MOUNTS, {
        "/sys/fs/cgroup/slice": _v2("max", 2 * GIB, 0)})
    assert host_available_memory(free) == AvailableMemory(20 * GIB, "MemAvailable")


def test_v2_over_its_limit_has_no_headroom(tmp_path):
    files = _tree(tmp_path, "0::/full\n", V2_MOUNTS, {
        "/sys/fs/cgroup/full": _v2(str(GIB), 2 * GIB, GIB // 2)})
    assert host_available_memory(files).num_bytes == 0


def test_v1_memory_controller_in_a_hybrid_host(tmp_path):
    """As on this project's machines: v1 controllers, a v2 line with no controllers."""
    cgroup = "4:memory:/process_api/abc\n3:cpuset:/\n0::/\n"
    files = _tree(tmp_path, cgroup, V1_MOUNTS, {
        "/sys/fs/cgroup/memory": {"memory.limit_in_bytes": V1_UNLIMITED,
                                  "memory.usage_in_bytes": "1", "memory.stat": ""},
        "/sys/fs/cgroup/memory/process_api/abc": {
            "memory.limit_in_bytes": str(2 * GIB), "memory.usage_in_bytes": str(GIB),
            "memory.stat": f"inactive_file 5\ntotal_inactive_file {GIB // 4}\n"},
    })
    top = tmp_path / "sys/fs/cgroup/memory"
    assert cgroup_dirs(files) == (1, [top / "process_api/abc", top / "process_api", top])
    assert host_available_memory(files) == AvailableMemory(
        2 * GIB - (GIB - GIB // 4), f"cgroup v1 {top / 'process_api/abc'}")


def test_container_namespace_path_outside_the_mount_root_reads_the_mount_point(tmp_path):
    """A container with its own cgroup namespace: the host path is not under the mounted
    root, and the mount point is the container's own cgroup."""
    mounts = "30 23 0:26 /docker/c1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n"
    files = _tree(tmp_path, "0::/other\n", mounts, {
        "/sys/fs/cgroup": _v2(str(3 * GIB), GIB, 0)})
    assert cgroup_dirs(files) == (2, [tmp_path / "sys/fs/cgroup"])
    assert host_available_memory(files).num_bytes == 2 * GIB


def test_no_memory_cgroup_mounted(tmp_path):
    files = _tree(tmp_path, "0::/x\n", "31 23 0:28 / /proc rw - proc proc rw\n", {})
    assert cgroup_dirs(files) == (0, [])
    assert host_available_memory(files) == AvailableMemory(20 * GIB, "MemAvailable")


def _writable_child_cgroup() -> Path | None:
    """A new child of this process's v1 or v2 memory cgroup, or None where one cannot be
    made (no permission, a read-only /sys/fs/cgroup, v2 without the memory controller)."""
    version, dirs = cgroup_dirs(ProcFiles())
    if not dirs:
        return None
    child = dirs[0] / f"widellm-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError:
        return None
    limit = child / ("memory.max" if version == 2 else "memory.limit_in_bytes")
    if not limit.exists():
        child.rmdir()
        return None
    return child


def test_a_process_in_a_limited_cgroup_sees_the_limit():
    child = _writable_child_cgroup()
    if child is None:
        pytest.skip("cannot create a child memory cgroup here")
    limit_bytes = 512 << 20
    version = 2 if (child / "memory.max").exists() else 1
    try:
        (child / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(
            str(limit_bytes))
        code = ("from widellm.worker.host_memory import host_available_memory as h; "
                "m = h(); print(m.num_bytes); print(m.source)")
        # The shell joins the cgroup, then execs Python: only that process is limited.
        run = subprocess.run(["sh", "-c", f'echo $$ > "{child}/cgroup.procs" && exec "$0" -c '
                              f'"$1"', sys.executable, code], capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT_S, cwd=os.getcwd())
        assert run.returncode == 0, run.stderr
        num_bytes, source = run.stdout.splitlines()
        assert source == f"cgroup v{version} {child}"
        assert 0 < int(num_bytes) < limit_bytes  # the interpreter itself uses some
    finally:
        child.rmdir()
