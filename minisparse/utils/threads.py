"""How many threads torch's CPU operations use, chosen for the machine a run is on.

torch starts one thread per logical CPU. Where another job keeps a core busy, a decode
step then waits for its slowest thread, which shares a core with that job: on 2 cores
kept busy by other jobs the quick start's rollout sampled 33 tokens/s with 2 threads and
118 with 1 (docs/memory.md, "On a CPU"). So a run that is not told otherwise takes one
thread per physical core it may use (its CPU affinity, a container's CPU quota), less the
cores other work keeps busy (measured over a fraction of a second at start), and never
fewer than one.
OMP_NUM_THREADS, where set, is the user's choice and is kept; the config key cpu_threads
(> 0) wins over both.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLE_S = 0.3  # how long the other work on the cores is measured for
ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str  # how the number was chosen, as the start line says it

    def line(self) -> str:
        """The start line: the number, why, and how to change it."""
        return (f"threads: {self.threads} ({self.why}); change with --set cpu_threads=N "
                f"or {ENV}=N")


def choose_threads(setting: int, env: str | None, cores: int, busy: float) -> ThreadChoice:
    """The thread count from cpu_threads (`setting`, 0: not set), OMP_NUM_THREADS (`env`),
    the physical cores this process may use and how many of them other work keeps busy."""
    if setting > 0:
        return ThreadChoice(setting, "cpu_threads")
    if _count(env):
        return ThreadChoice(_count(env), ENV)
    taken = min(cores - 1, max(0, round(busy)))
    cores_text = f"{cores} physical core{'s' if cores != 1 else ''}"
    if not taken:
        return ThreadChoice(cores, cores_text)
    return ThreadChoice(cores - taken, f"{cores_text}, {busy:.1f} busy with other work")


def _count(env: str | None) -> int:
    """OMP_NUM_THREADS as a thread count; 0 where it is unset or not a positive number."""
    text = (env or "").strip()
    return int(text) if text.isdigit() else 0


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int:
    """Physical cores among `cpus` (hyper-thread siblings counted once), capped by a
    cgroup CPU quota (a container's --cpus)."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    found = max(1, len(cores))
    quota = cgroup_cpus()
    return max(1, min(found, math.ceil(quota))) if quota else found


def cgroup_cpus() -> float | None:
    """CPUs a cgroup v2 (cpu.max) or v1 (cfs quota) limit allows; None: no limit."""
    for path, split in (("/sys/fs/cgroup/cpu.max", None),
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "cpu.cfs_period_us")):
        try:
            text = Path(path).read_text().split()
            if split:
                text = [text[0], Path(path).with_name(split).read_text().strip()]
        except (OSError, IndexError):
            continue
        if text and text[0] not in ("max", "-1") and len(text) == 2:
            return int(text[0]) / int(text[1])
    return None


def _cpu_times(cpus: list[int]) -> tuple[float, float]:
    """(busy, total) clock ticks of `cpus` since boot, from /proc/stat."""
    wanted, busy, total = {f"cpu{c}" for c in cpus}, 0, 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name in wanted:
                ticks = [int(v) for v in fields[:8]]
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    return busy, total


def busy_cores(cpus: list[int], seconds: float = SAMPLE_S) -> float:
    """Cores' worth of work other processes did on `cpus` over `seconds` (this process's
    own use taken out); 0 where /proc/stat cannot be read."""
    try:
        busy0, total0 = _cpu_times(cpus)
        own0 = sum(os.times()[:2])
        time.sleep(seconds)
        busy1, total1 = _cpu_times(cpus)
        own1 = sum(os.times()[:2])
    except (OSError, ValueError):
        return 0.0
    if total1 <= total0:
        return 0.0
    share = (busy1 - busy0) / (total1 - total0)  # of all cpus' time
    own = (own1 - own0) / seconds  # cores' worth this process used
    return max(0.0, share * len(cpus) - own)


def set_threads(setting: int) -> ThreadChoice:
    """Choose and apply torch's intra-op thread count (see the module docstring)."""
    import torch

    env = os.environ.get(ENV)
    cpus = allowed_cpus()
    cores = physical_cores(cpus)
    busy = 0.0 if setting > 0 or _count(env) else busy_cores(cpus)  # measured if needed
    choice = choose_threads(setting, env, cores, busy)
    torch.set_num_threads(choice.threads)
    return choice
