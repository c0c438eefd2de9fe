"""The CPU and memory limits of the control group this process runs in.

Why: inside a container (Docker `--cpus` / `--memory`, a Kubernetes pod's
limits) /proc/meminfo and the CPU count describe the host. Sizing the KV
cache from the host's free memory can ask for many times the container's
limit (the kernel then kills the process), and one OpenMP thread per host
core under a 2-CPU quota leaves threads spinning at barriers while the
scheduler throttles the group. Both limits are read from cgroup files: v2
(`cpu.max`, `memory.max`, `memory.current`) or v1 (`cpu.cfs_quota_us` /
`cpu.cfs_period_us`, `memory.limit_in_bytes`, `memory.usage_in_bytes`).

A limit set on any ancestor group binds too, so every group from this
process's own up to the root of the mount is read and the tightest wins.
A file that is missing or unreadable is no limit (bare metal, macOS, an
unmounted controller): these helpers never raise for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712).
_UNLIMITED_BYTES = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    limit_bytes: int  # the tightest limit of this process's group and its ancestors
    usage_bytes: int  # what that group has charged now (page cache included)
    group: Path  # the group directory whose limit binds

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.usage_bytes)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _own_groups(proc_self_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's group path, from /proc/self/cgroup
    ("0::/path" for v2, "4:memory:/path" or "2:cpu,cpuacct:/path" for v1)."""
    text = _read(proc_self_cgroup) or ""
    groups: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else ["unified"]:
            groups[c] = path
    return groups


def _candidate_dirs(mount: Path, group: str | None) -> list[Path]:
    """The process's group directory under `mount` and each of its ancestors
    up to `mount` itself (tightest-first does not matter: callers take the min).
    A group path that does not exist under the mount (a namespaced container
    sees its own group as the root) leaves just the mount."""
    dirs = [mount]
    if group and group != "/":
        d = mount
        for part in Path(group).parts[1:]:
            d = d / part
            dirs.append(d)
    return [d for d in dirs if d.is_dir()]


def _v1_mount(root: Path, controller: str) -> Path | None:
    # v1 mounts the cpu controller alone or co-mounted with cpuacct.
    names = ("cpu", "cpu,cpuacct", "cpuacct,cpu") if controller == "cpu" else (controller,)
    return next((root / n for n in names if (root / n).is_dir()), None)


def cpu_quota(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """CPUs' worth of time per period this group may use (2.0 for `--cpus 2`),
    or None where no quota is set (or none can be read)."""
    try:
        return _cpu_quota(root, proc_self_cgroup)
    except OSError:  # e.g. a directory we may not stat
        return None


def _cpu_quota(root: Path, proc_self_cgroup: Path) -> float | None:
    groups = _own_groups(proc_self_cgroup)
    quotas: list[float] = []
    if (root / "cgroup.controllers").is_file():  # v2, unified hierarchy
        for d in _candidate_dirs(root, groups.get("unified")):
            fields = (_read(d / "cpu.max") or "").split()
            if len(fields) == 2 and fields[0] != "max":
                try:
                    quota, period = int(fields[0]), int(fields[1])
                except ValueError:
                    continue
                if quota > 0 and period > 0:
                    quotas.append(quota / period)
    else:
        mount = _v1_mount(root, "cpu")
        if mount is not None:
            for d in _candidate_dirs(mount, groups.get("cpu")):
                try:
                    quota = int(_read(d / "cpu.cfs_quota_us") or "-1")
                    period = int(_read(d / "cpu.cfs_period_us") or "0")
                except ValueError:
                    continue
                if quota > 0 and period > 0:
                    quotas.append(quota / period)
    return min(quotas) if quotas else None


def memory_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> MemoryLimit | None:
    """The binding memory limit of this process's group, or None where none
    is set (or none can be read)."""
    try:
        return _memory_limit(root, proc_self_cgroup)
    except OSError:
        return None


def _memory_limit(root: Path, proc_self_cgroup: Path) -> MemoryLimit | None:
    groups = _own_groups(proc_self_cgroup)
    if (root / "cgroup.controllers").is_file():
        dirs, limit_file, usage_file = _candidate_dirs(root, groups.get("unified")), "memory.max", "memory.current"
    else:
        mount = _v1_mount(root, "memory")
        if mount is None:
            return None
        dirs, limit_file, usage_file = _candidate_dirs(mount, groups.get("memory")), "memory.limit_in_bytes", \
            "memory.usage_in_bytes"
    best: MemoryLimit | None = None
    for d in dirs:
        text = _read(d / limit_file)
        if text is None or text == "max":
            continue
        try:
            limit = int(text)
            usage = int(_read(d / usage_file) or "0")
        except ValueError:
            continue
        if 0 < limit < _UNLIMITED_BYTES:
            candidate = MemoryLimit(limit, usage, d)
            if best is None or candidate.available_bytes < best.available_bytes:
                best = candidate
    return best


def usable_cpus(affinity: int, quota: float | None) -> int:
    """Threads worth running: the CPUs this process may be scheduled on,
    capped by the quota rounded up (a 2.5-CPU quota keeps 3 threads busy)."""
    n = max(1, affinity)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return n
