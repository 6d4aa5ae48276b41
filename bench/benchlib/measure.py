"""Readings every benchmark takes: latency histograms, and a process's CPU and memory from
/proc (user and system seconds, RSS, peak RSS), the machine's busy CPU, and an RSS sampler.

Reads /proc files and nothing else; starts no process (see servers.py for those).
"""

from __future__ import annotations

import os
import threading
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- latency histograms ----------------------------------------------------------------------
# Keys are latencies in ns rounded down to 8 significant bits (< 0.8 % error); values are
# counts: small enough to send back from worker processes, and mergeable.


def bucket(ns: int) -> int:
    """A latency in ns rounded down to 8 significant bits (a log-linear histogram key)."""
    b = ns.bit_length()
    if b <= 8:
        return ns
    s = b - 8
    return (ns >> s) << s


def merge_hist(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        into[k] = into.get(k, 0) + v


def percentiles(hist: dict[int, int], ps: tuple[float, ...]) -> list[float]:
    """Latency percentiles in ms (nan when empty)."""
    total = sum(hist.values())
    if not total:
        return [float("nan")] * len(ps)
    keys = sorted(hist)
    out: list[float] = []
    for p in ps:
        rank = max(1, int(p / 100 * total + 0.999999))
        cum = 0
        for k in keys:
            cum += hist[k]
            if cum >= rank:
                out.append(k / 1e6)
                break
    return out


# -- /proc -----------------------------------------------------------------------------------


def proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads (nan, nan if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return float("nan"), float("nan")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    return sum(proc_cpu(pid))


def system_busy_s() -> float:
    """CPU seconds all CPUs spent not idle (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
        return (user + nice + system + irq + softirq + steal) / CLK_TCK
    except (OSError, ValueError):
        return float("nan")


def kib_field(path: str, key: str) -> int | None:
    """The `key:` line of a /proc file in kB (/proc/meminfo, /proc/<pid>/status), or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_kib(pid: int) -> int | None:
    """A process's resident set now (VmRSS), KiB."""
    return kib_field(f"/proc/{pid}/status", "VmRSS")


def hwm_kib(pid: int) -> int | None:
    """A process's peak resident set so far (VmHWM), KiB."""
    return kib_field(f"/proc/{pid}/status", "VmHWM")


class RssSampler:
    """Samples a process's VmRSS every `interval` s in a thread; `phase` names the samples
    (set it as the benchmark moves on); `max_kib` is the highest seen."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, str, int]] = []  # (monotonic t, phase, KiB)
        self.phase = "idle"
        self.max_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> int | None:
        kib = rss_kib(self.pid)
        if kib is not None:
            self.samples.append((time.monotonic(), self.phase, kib))
            self.max_kib = max(self.max_kib, kib)
        return kib

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sample() is None:
                return  # the process is gone
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

    def phase_stats(self, phase: str) -> tuple[int, int, int] | None:
        """(min, max, last) KiB of the samples of `phase`, or None."""
        vals = [k for _, p, k in self.samples if p == phase]
        if not vals:
            return None
        return min(vals), max(vals), vals[-1]


class CpuWindow:
    """CPU over a stretch of wall time: a process's user and system seconds and the whole
    machine's busy seconds, read at `start()` (or construction) and at `stop()`. `other_s`
    is what the rest of the machine used meanwhile, given the CPU the benchmark's own
    clients used."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.user_s = self.sys_s = self.busy_s = self.wall_s = 0.0
        self.start()

    def start(self) -> None:
        self._u0, self._s0 = proc_cpu(self.pid)
        self._b0, self._t0 = system_busy_s(), time.monotonic()

    def stop(self) -> CpuWindow:
        u1, s1 = proc_cpu(self.pid)
        self.user_s, self.sys_s = u1 - self._u0, s1 - self._s0
        self.busy_s = system_busy_s() - self._b0
        self.wall_s = time.monotonic() - self._t0
        return self

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    def other_s(self, clients_s: float = 0.0) -> float:
        return max(0.0, self.busy_s - self.cpu_s - clients_s)
