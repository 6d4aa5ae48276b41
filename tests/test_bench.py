"""Every benchmark in bench/ runs, so that bench/ cannot rot: each script in a smoke mode
(tiny sizes, fractions of a second per phase), through the harness (bench/benchlib/).

A run passes when it exits 0, prints the figures it exists for, and kept its output in
the results directory (here a temp dir). Never a figure's value: tests do not assert on
speed. The runs go three at a time, each in its own process group. darner and py-spy runs
are skipped only when the tool is absent, saying so. The Spark benchmarks' Spark phases
run on the suite's SparkSession instead (tests/test_spark_bench.py): a JVM of their own
would cost more than all of these.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
DARNER = Path(os.environ.get("PEERS", "/tmp/peers")) / "darner" / "build" / "darner"
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
PARALLEL = 3
TIMEOUT = 240.0  # s, one smoke run at most (they take 1-10 s)


@dataclass(frozen=True)
class Smoke:
    script: str
    args: tuple[str, ...]  # "{tmp}" stands for the run's own temp dir
    expect: str  # a line of the report the run must print (a regex)
    needs: str = ""  # "darner", "py-spy" or "valgrind": skipped without it
    name: str = ""  # when a script has several runs


#: name -> the smoke run. Every script in bench/ has one (test_every_script_has_a_smoke_run).
SMOKE = {s.name or s.script: s for s in [
    Smoke("backoff_bench", ("--items", "200", "--pairs", "1"),
          r"with / without, items/s: median"),
    Smoke("backoff_bench", ("--in-process", "--items", "200", "--pairs", "2"),
          r"without / with, CPU per item: median [0-9.]+", name="backoff_bench --in-process"),
    Smoke("callgrind_items", ("--dir", "{tmp}", "--workload", "latency,rpc-getconfirm",
                              "--items", "30", "--warm", "5"),
          r"\| this venv \| latency \| 1 x 1, 1 \| [0-9,]+ \|\n"
          r"\| this venv \| rpc-getconfirm \| 4 x 1, 1 \| [0-9,]+ \|", needs="valgrind"),
    Smoke("dedup_bench", ("--seconds", "0.2", "--rounds", "1", "--conns", "1", "--window",
                          "8", "--fsync", "never"),
          r"  resent +[0-9]+ +[0-9.]+ +[0-9.]+"),
    Smoke("delay_bench", ("--items", "2000", "--late-items", "3"), r"lateness of 3 items due"),
    Smoke("fsync_forms", ("--dir", "{tmp}", "--syncs", "20", "--size", "100", "--rounds", "1"),
          r"\| overwrite zeros \+ fdatasync \| [0-9.]+ \| [0-9.]+ \|"),
    Smoke("fuzz_rss", ("--inputs", "2000", "--per-conn", "100", "--idle", "0"),
          r"after 0 s idle .*: [0-9.]+ \(target <= 1.10\)"),
    Smoke("headers_mem", ("--items", "2000", "--modes", "2"),
          r"2 headers: RSS idle [0-9.]+ MiB, -?[0-9.]+ B per held item"),
    Smoke("heartbeat_bench", ("--leases", "20", "--conns", "2", "--lease-ms", "600",
                              "--intervals", "1"),
          r"heartbeats alone: [0-9.]+ % of a core"),
    Smoke("journal_bench", ("--dir", "{tmp}", "--quick", "--sizes", "64", "--recovery-sizes",
                            "64", "--recovery-bytes", "2MiB", "--max-bytes", "1MiB",
                            "--seconds", "0.1", "--pairs", "1"),
          r"64 B: recovery, cold \| [0-9,]+ items/s"),
    Smoke("load", ("--dir", "{tmp}", "--target", "queued", "--items", "500", "--seconds",
                   "0.3", "--payload", "64", "--fsync", "never", "--procs", "1", "--rss",
                   "--rss-backlog", "256KiB"),
          r"\| 64 B \| never \| steady \| get \| [0-9,]+ \|"),
    Smoke("metrics_bench", ("--queues", "20", "--scrapes", "3", "--seconds", "0.3"),
          r"RPC version ping while scraping \(\d+ scrapes\): \d+ pings"),
    Smoke("pass_bench", ("--dir", "{tmp}", "--passes", "20", "--rounds", "2", "--queues", "5",
                         "--per-pass", "4"),
          r"CPU per put: best [0-9.]+ us, median [0-9.]+ us \(2 rounds of 40 puts\)"),
    Smoke("producer_mem", ("1000", "16"), r"1000 producers, 16-byte ids: \d+ B"),
    Smoke("producer_mem", ("--keys", "1000", "16"), r"1000 keys, 16-byte keys: \d+ B",
          name="producer_mem --keys"),
    Smoke("queue_mem", ("--queues", "20", "--how", "empty", "--top", "3"),
          r"empty: \d+ queues \(0 parked\); per queue: heap -?\d+ B"),
    Smoke("queue_mem", ("--load-cost", "--loads", "3"),
          r"one load at the parking limits: median [0-9.]+ ms", name="queue_mem --load-cost"),
    Smoke("request_profile", ("--workload", "rpc-getconfirm", "--conns", "2", "--requests",
                              "100", "--no-profile"),
          r"server CPU per request: user [0-9.]+ us"),
    Smoke("request_profile", ("--workload", "rpc-put-idem", "--conns", "2", "--requests",
                              "100", "--no-profile"),
          r"rpc-put-idem, .* \(10,000 items\).*\n.*per item: [0-9.]+ us",
          name="request_profile rpc-put-idem"),
    Smoke("request_profile", ("--workload", "set", "--conns", "2", "--requests", "1000",
                              "--top", "3"),
          r"samples with the GIL held|py-spy recorded no samples", needs="py-spy",
          name="request_profile with py-spy"),
    Smoke("rpc_bench", ("--seconds", "0.2", "--fsync", "never", "--sizes", "64", "--batches",
                        "100", "--conns", "1", "--tasks", "2", "--tls"),
          r"\| never \| yes \| 64 B \| 100 \| 1 \| get\+confirm \| [0-9,]+ \|"),
    Smoke("rpc_bench", ("--put-variants", "1", "--seconds", "0.2", "--fsync", "never",
                        "--conns", "1"),
          r"### fsync never: medians of 1 rounds", name="rpc_bench --put-variants"),
    Smoke("spark_write_bench", ("--rows", "1000", "--repeat", "1", "--skip-spark"),
          r"bare Client.put loop, 2 proc, batch 5000 +[0-9,]+ rows/s"),
    Smoke("vs_darner", ("--dir", "{tmp}", "--quick", "--runs", "1", "--scale", "0.05",
                        "--seconds", "0.3", "--workloads", "latency,fanin-lp", "--targets",
                        "queued-never"),
          r"\| fanin-lp \| 64 B \| get \| queued-never \| [0-9,]+ \|"),
    Smoke("vs_darner", ("--dir", "{tmp}", "--quick", "--runs", "1", "--seconds", "1",
                        "--workloads", "steady", "--steady-rate", "2000",
                        "--targets", "queued-never"),
          # (paced: about 2,000 puts a second, not the tens of thousands unpaced)
          r"producers paced to 2,000 items/s[\s\S]*"
          r"\| steady \| 64 B \| put \| queued-never \| (1,[5-9][0-9]{2}|2,[0-2][0-9]{2}) \|",
          name="vs_darner --steady-rate"),
    Smoke("vs_darner", ("--dir", "{tmp}", "--quick", "--runs", "1", "--scale", "0.02",
                        "--workloads", "drain", "--targets", "queued-never,queued-always,darner"),
          r"\| drain \| 1 KiB \| dequeue \| [0-9,]+ \| [0-9,]+ \| [0-9,]+ \| [0-9.]+ \|"
          r"[\s\S]*- drain 64 B enqueue: darner's round trip [0-9.]+ ms, ceiling [0-9.]+ of "
          r"darner: "
          r"queued-always [0-9.]+ \([0-9.]+ of the ceiling\)",
          needs="darner", name="vs_darner with darner"),
]}
#: started first, so that the pool is not left with one long run at the end
SLOWEST = ("load", "vs_darner", "headers_mem", "backoff_bench", "rpc_bench")
#: run in the suite's process, on its SparkSession: tests/test_spark_bench.py
IN_PROCESS = {"spark_bench"}


def missing(needs: str) -> str:
    """Why a smoke run cannot run here, or ""."""
    if needs == "darner" and not DARNER.exists():
        return (f"darner is not built ({DARNER}; PEERS=/tmp/peers "
                "/work/shared/peers/build-darner.sh builds it)")
    if needs == "py-spy" and not Path(PY_SPY).exists():
        return "py-spy is not installed (pip install py-spy)"
    if needs == "valgrind" and shutil.which("callgrind_control") is None:
        return "valgrind is not installed (apt-get install valgrind)"
    return ""


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    kept: dict[str, str]  # results directory: file name -> text


def run(smoke: Smoke, results: Path) -> Run:
    """The script in its own process group (killed whole, by its id, at the timeout, so no
    server it started outlives it), with its results directory set to `results` and its
    temp dirs (the servers' data dirs among them) beside it."""
    results.mkdir(parents=True)
    tmp = results.with_name(results.name + "-tmp")
    tmp.mkdir()
    env = {**os.environ, "QUEUED_BENCH_RESULTS": str(results), "PYTHONUNBUFFERED": "1",
           "TMPDIR": str(tmp)}
    t0 = time.monotonic()
    args = [a.replace("{tmp}", str(tmp)) for a in smoke.args]
    proc = subprocess.Popen([sys.executable, str(BENCH / f"{smoke.script}.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, _ = proc.communicate()
        out += f"\n!! killed after {TIMEOUT:g} s".encode()
    kill_group(proc.pid)  # anything a failed run left behind (a server, a worker)
    kept = {p.name: p.read_text(errors="replace") for p in sorted(results.iterdir())}
    return Run(proc.returncode, out.decode(errors="replace"), time.monotonic() - t0, kept)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    """Every subprocess smoke run that can run here, started in the background."""
    root = tmp_path_factory.mktemp("bench-smoke")
    with ThreadPoolExecutor(PARALLEL) as pool:
        order = sorted(SMOKE, key=lambda name: name not in SLOWEST)
        futures = {name: pool.submit(run, SMOKE[name], root / re.sub(r"\W+", "-", name))
                   for name in order if not missing(SMOKE[name].needs)}
        yield futures
        for f in futures.values():
            f.cancel()


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_benchmark_runs(name: str, runs: dict[str, Future[Run]]) -> None:
    smoke = SMOKE[name]
    why = missing(smoke.needs)
    if why:
        pytest.skip(f"{name}: {why}")
    r = runs[name].result(timeout=3 * TIMEOUT)
    tail = r.output[-3000:]
    assert r.returncode == 0, f"{name} exited {r.returncode} after {r.seconds:.1f} s:\n{tail}"
    assert re.search(smoke.expect, r.output), f"{name} did not print /{smoke.expect}/:\n{tail}"
    assert "Traceback" not in r.output, tail
    texts = [t for n, t in r.kept.items() if n.startswith(smoke.script) and n.endswith(".txt")]
    assert len(texts) == 1, f"{name} kept {sorted(r.kept)}"
    assert texts[0].strip() and texts[0].strip() in r.output  # what it printed, as printed
    if smoke.script == "vs_darner":
        assert any(n.endswith(".json") for n in r.kept), sorted(r.kept)


def test_every_script_has_a_smoke_run() -> None:
    """A new benchmark gets a smoke run here (or it would rot unnoticed)."""
    scripts = {p.stem for p in BENCH.glob("*.py")}
    covered = {s.script for s in SMOKE.values()} | IN_PROCESS
    assert scripts - covered == set(), "add a smoke run to SMOKE for these"
    assert covered - scripts == set(), "SMOKE names scripts that are gone"


def test_only_the_harness_starts_servers() -> None:
    """No script starts `queued serve` (or redis) by itself: bench/benchlib/ does, for
    all of them."""
    for p in BENCH.glob("*.py"):
        text = p.read_text()
        assert not re.search(r"""["']serve["']|["']redis-server["']\s*,\s*["']--port""",
                             text), f"{p.name} starts a server itself: use benchlib"


def test_no_results_in_git() -> None:
    """Runs are kept outside git (bench/results/ is ignored): none is committed."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "bench/results"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert tracked == "", f"result files in git (git rm them):\n{tracked}"


def test_vs_darner_always_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ceiling of fsync always against darner: darner's mean round trip (puts in flight
    over its items/s) over that plus one fdatasync, for the enqueues only, and where each
    always target stands against it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import vs_darner

    def cell(items_per_s: float, p50_ms: float) -> dict[str, float]:
        return {"items_per_s": items_per_s, "p50_ms": p50_ms}

    index = {("drain", 64, "enqueue", "darner"): cell(100_000, 0.2),  # 32 in flight: 0.32 ms
             ("drain", 64, "enqueue", "queued-always"): cell(30_000, 1.0),
             ("drain", 64, "dequeue", "darner"): cell(100_000, 0.2),
             ("many", 64, "enqueue", "queued-always"): cell(9_000, 1.0)}  # no darner cell
    lines = vs_darner.always_ceiling_lines(
        0.08, ["queued-always"], [("drain", 64, "enqueue"), ("drain", 64, "dequeue"),
                                  ("many", 64, "enqueue")], index)
    rows = [line for line in lines if line.startswith("- ")]
    assert rows == ["- drain 64 B enqueue: darner's round trip 0.320 ms, ceiling 0.80 of "
                    "darner: queued-always 0.30 (0.38 of the ceiling)"]
    assert vs_darner.always_ceiling_lines(0.1, ["queued-always"], [("many", 64, "enqueue")],
                                          index) == []
