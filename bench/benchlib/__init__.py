"""Measuring helpers shared by the benchmarks: latency histograms, /proc CPU readings, and
throwaway TLS certificates for the runs over TLS.

Owns nothing but these pure-ish readers (the /proc ones read files, nothing else) and the
certificate files; every benchmark script imports them from here (scripts run as
`python bench/x.py`, so this folder is on sys.path, in spawned workers too).
"""

from __future__ import annotations

import os

CLK_TCK = os.sysconf("SC_CLK_TCK")


def bucket(ns: int) -> int:
    """A latency in ns rounded down to 8 significant bits (a log-linear histogram key)."""
    b = ns.bit_length()
    if b <= 8:
        return ns
    s = b - 8
    return (ns >> s) << s


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


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return float("nan")


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
    except OSError:
        pass
    return None


class BenchCerts:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost, as PEM files in
    `where`, for benchmarks over TLS (trustme, from the test extras; made once per run)."""

    def __init__(self, where: str) -> None:
        import trustme

        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        self.ca = os.path.join(where, "bench-ca.pem")
        self.cert = os.path.join(where, "bench-server.pem")
        self.key = os.path.join(where, "bench-server.key")
        ca.cert_pem.write_to_path(self.ca)
        leaf.private_key_pem.write_to_path(self.key)
        with open(self.cert, "wb") as f:
            f.write(b"".join(p.bytes() for p in leaf.cert_chain_pems))

    def server_args(self) -> list[str]:
        """The `queued serve` flags that turn TLS on for every listener."""
        return ["--tls-cert", self.cert, "--tls-key", self.key]
