"""Container limits read from cgroup v1/v2 trees built under tmp_path (the
same files the kernel exposes), and what the engine does with them."""

import os

import pytest
import torch

from fp8serve.utils import cgroup, platform

GiB = 1 << 30


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(tmp_path, own_group="/"):
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpuset cpu io memory pids\n")
    proc = tmp_path / "proc_self_cgroup"
    write(proc, f"0::{own_group}\n")
    return root, proc


def v1_tree(tmp_path, cpu_dir="cpu,cpuacct", own_group="/"):
    root = tmp_path / "cgroup"
    (root / cpu_dir).mkdir(parents=True)
    (root / "memory").mkdir(parents=True)
    proc = tmp_path / "proc_self_cgroup"
    write(proc, f"4:memory:{own_group}\n2:cpu,cpuacct:{own_group}\n1:name=systemd:/\n")
    return root, proc


@pytest.mark.parametrize("text, expected", [
    ("200000 100000\n", 2.0),  # docker --cpus 2
    ("250000 100000", 2.5),
    ("max 100000", None),  # no quota
    ("garbage", None),  # unreadable content is no limit, never an error
    ("0 100000", None),
])
def test_v2_cpu_quota(tmp_path, text, expected):
    root, proc = v2_tree(tmp_path)
    write(root / "cpu.max", text)
    assert cgroup.cpu_quota(root, proc) == expected


def test_v2_quota_of_an_ancestor_binds(tmp_path):
    # The process sits in /pod/app; the pod's group has the 1.5-CPU limit, its own none.
    root, proc = v2_tree(tmp_path, own_group="/pod/app")
    write(root / "cpu.max", "max 100000")
    write(root / "pod" / "cpu.max", "150000 100000")
    write(root / "pod" / "app" / "cpu.max", "max 100000")
    assert cgroup.cpu_quota(root, proc) == 1.5
    write(root / "pod" / "app" / "cpu.max", "100000 100000")  # a tighter one below wins
    assert cgroup.cpu_quota(root, proc) == 1.0


@pytest.mark.parametrize("cpu_dir", ["cpu,cpuacct", "cpu"])
def test_v1_cpu_quota(tmp_path, cpu_dir):
    root, proc = v1_tree(tmp_path, cpu_dir=cpu_dir)
    write(root / cpu_dir / "cpu.cfs_quota_us", "-1\n")
    write(root / cpu_dir / "cpu.cfs_period_us", "100000\n")
    assert cgroup.cpu_quota(root, proc) is None
    write(root / cpu_dir / "cpu.cfs_quota_us", "50000\n")
    assert cgroup.cpu_quota(root, proc) == 0.5


def test_no_cgroup_mount_means_no_limits(tmp_path):
    root, proc = tmp_path / "missing", tmp_path / "missing_proc"
    assert cgroup.cpu_quota(root, proc) is None
    assert cgroup.memory_limit(root, proc) is None


def test_v2_memory_limit_and_usage(tmp_path):
    root, proc = v2_tree(tmp_path, own_group="/job")
    write(root / "job" / "memory.max", str(4 * GiB))
    write(root / "job" / "memory.current", str(1 * GiB))
    lim = cgroup.memory_limit(root, proc)
    assert (lim.limit_bytes, lim.usage_bytes, lim.available_bytes) == (4 * GiB, GiB, 3 * GiB)
    assert lim.group == root / "job"
    write(root / "job" / "memory.max", "max\n")
    assert cgroup.memory_limit(root, proc) is None


def test_v2_memory_the_tightest_group_binds(tmp_path):
    root, proc = v2_tree(tmp_path, own_group="/pod/app")
    write(root / "pod" / "memory.max", str(8 * GiB))
    write(root / "pod" / "memory.current", str(7 * GiB))  # siblings use most of the pod's limit
    write(root / "pod" / "app" / "memory.max", str(4 * GiB))
    write(root / "pod" / "app" / "memory.current", str(1 * GiB))
    lim = cgroup.memory_limit(root, proc)
    assert lim.group == root / "pod" and lim.available_bytes == 1 * GiB


def test_v1_memory_limit(tmp_path):
    root, proc = v1_tree(tmp_path)
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    write(root / "memory" / "memory.usage_in_bytes", str(GiB))
    assert cgroup.memory_limit(root, proc) is None
    write(root / "memory" / "memory.limit_in_bytes", str(2 * GiB))
    assert cgroup.memory_limit(root, proc).available_bytes == GiB


@pytest.mark.parametrize("affinity, quota, expected", [
    (64, 2.0, 2),  # a 2-CPU container on a 64-core host
    (2, None, 2),
    (8, 2.5, 3),  # a fractional quota still keeps the next thread busy part of the time
    (4, 0.5, 1),
    (1, 8.0, 1),  # taskset to one CPU
    (0, None, 1),
])
def test_usable_cpus(affinity, quota, expected):
    assert cgroup.usable_cpus(affinity, quota) == expected


def test_available_memory_is_capped_by_the_container(monkeypatch):
    monkeypatch.setattr(platform, "_meminfo_available_bytes", lambda: 20 * GiB)
    monkeypatch.setattr(cgroup, "memory_limit", lambda: cgroup.MemoryLimit(6 * GiB, 2 * GiB, cgroup.CGROUP_ROOT))
    assert platform.available_memory_bytes() == 4 * GiB
    monkeypatch.setattr(cgroup, "memory_limit", lambda: cgroup.MemoryLimit(64 * GiB, 0, cgroup.CGROUP_ROOT))
    assert platform.available_memory_bytes() == 20 * GiB
    monkeypatch.setattr(cgroup, "memory_limit", lambda: None)
    assert platform.available_memory_bytes() == 20 * GiB


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_threads_are_capped_by_the_quota(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(cgroup, "cpu_quota", lambda: 1.0)
    torch.set_num_threads(2)
    assert platform.configure_cpu_threads() == 1
    assert torch.get_num_threads() == 1
    # Never raised: with no quota the 64 CPUs allow more, and the count already set stays.
    monkeypatch.setattr(cgroup, "cpu_quota", lambda: None)
    assert platform.configure_cpu_threads() == 1


def test_explicit_omp_num_threads_is_left_alone(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(cgroup, "cpu_quota", lambda: 1.0)
    torch.set_num_threads(2)
    assert platform.configure_cpu_threads() == 2
    assert torch.get_num_threads() == 2


def test_unreadable_tree_is_no_limit(tmp_path, monkeypatch):
    root, proc = v2_tree(tmp_path)
    write(root / "cpu.max", "100000 100000")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(root), "is_file", denied)
    assert cgroup.cpu_quota(root, proc) is None
    assert cgroup.memory_limit(root, proc) is None
