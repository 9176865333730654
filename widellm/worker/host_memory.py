"""How much memory this process may still take on its host.

``/proc/meminfo``'s MemAvailable is the host's view; in a container (Docker ``--memory``, a
Kubernetes limit, a systemd slice) the memory cgroup's limit ends the process first, so the
answer is the least of MemAvailable and the headroom of every memory cgroup from this
process's own up to its hierarchy's root:

* cgroup v2: ``memory.max - (memory.current - inactive_file)``, ``max`` meaning no limit;
* cgroup v1: ``memory.limit_in_bytes - (memory.usage_in_bytes - total_inactive_file)``, a
  limit of about 2**63 meaning none.

Inactive file pages are subtracted from the usage as the kernel reclaims them before it OOM
kills (Kubernetes' "working set" does the same), so a container full of page cache is not
mistaken for a full one.

Example: MemAvailable 20 GiB, v2 cgroup ``/kubepods/pod1`` with ``memory.max`` 8 GiB and
``memory.current`` 3 GiB of which 1 GiB inactive file, parent without limit: the answer is
8 - (3 - 1) = 6 GiB, from ``/kubepods/pod1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as the page counter's maximum in bytes (2**63 less a page);
# any limit this large is none.
V1_UNLIMITED_BYTES = 1 << 62


@dataclass(frozen=True, slots=True)
class ProcFiles:
    """Where the facts are read; tests point ``root`` at a fake tree (mount points from
    mountinfo are taken under it)."""

    root: Path = Path("/")
    meminfo: str = "proc/meminfo"
    cgroup: str = "proc/self/cgroup"
    mountinfo: str = "proc/self/mountinfo"

    def read(self, name: str) -> str:
        return (self.root / name).read_text()


@dataclass(frozen=True, slots=True)
class AvailableMemory:
    num_bytes: int
    source: str  # what set it: "MemAvailable" or the limiting cgroup, for the log


def mem_available(files: ProcFiles) -> int:
    for line in files.read(files.meminfo).splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"cannot read MemAvailable from {files.root / files.meminfo}")


def _memory_cgroup(files: ProcFiles) -> tuple[int, str] | None:
    """(version, path) of this process's memory cgroup: the v1 memory controller's line of
    /proc/self/cgroup if there is one, else the v2 line ("0::/path")."""
    v2 = None
    for line in files.read(files.cgroup).splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, path
        if hierarchy == "0" and controllers == "":
            v2 = (2, path)
    return v2


def _mount(files: ProcFiles, version: int) -> tuple[str, Path] | None:
    """(root of the mounted hierarchy, mount point) of the memory cgroup hierarchy."""
    for line in files.read(files.mountinfo).splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if (version == 2 and fstype == "cgroup2") or (
                version == 1 and fstype == "cgroup" and "memory" in options):
            return fields[3], Path(fields[4])
    return None


def cgroup_dirs(files: ProcFiles) -> tuple[int, list[Path]]:
    """The cgroup version and this process's memory cgroup folders, own first, up to the
    mount point; none where no memory cgroup is mounted. A path outside the mounted root (a
    container with its own cgroup namespace mounts only its own subtree) starts at the
    mount point itself."""
    found = _memory_cgroup(files)
    if found is None:
        return 0, []
    version, path = found
    mount = _mount(files, version)
    if mount is None:
        return 0, []
    mount_root, mount_point = mount
    inside = Path(path).is_relative_to(mount_root)
    relative = Path(path).relative_to(mount_root) if inside else Path()
    top = files.root / mount_point.relative_to("/")
    dirs = [top / relative]
    while dirs[-1] != top:
        dirs.append(dirs[-1].parent)
    return version, [d for d in dirs if d.is_dir()]


def _stat(folder: Path, key: str) -> int:
    for line in (folder / "memory.stat").read_text().splitlines():
        name, value = line.split()
        if name == key:
            return int(value)
    return 0


def cgroup_headroom(version: int, folder: Path) -> int | None:
    """Bytes this cgroup still allows; None without a limit (or without its files)."""
    names = {2: ("memory.max", "memory.current", "inactive_file"),
             1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
    limit_name, usage_name, inactive = names[version]
    try:
        limit = (folder / limit_name).read_text().strip()
        usage = int((folder / usage_name).read_text())
        reclaimable = _stat(folder, inactive)
    except FileNotFoundError:
        return None
    if limit == "max" or int(limit) >= V1_UNLIMITED_BYTES:
        return None
    return max(0, int(limit) - max(0, usage - reclaimable))


def host_available_memory(files: ProcFiles | None = None) -> AvailableMemory:
    """The least of MemAvailable and every enclosing memory cgroup's headroom."""
    files = files or ProcFiles()
    best = AvailableMemory(mem_available(files), "MemAvailable")
    version, dirs = cgroup_dirs(files)
    for folder in dirs:
        headroom = cgroup_headroom(version, folder)
        if headroom is not None and headroom < best.num_bytes:
            best = AvailableMemory(headroom, f"cgroup v{version} {folder}")
    return best
