#!/usr/bin/env python3
"""Journal engine benchmark: appends (fsync never / always) and recovery, against raw baselines.

Prints numbers, never asserts. Every figure is printed next to a raw baseline
measured in the same run on the same disk:

* raw ``os.write`` bandwidth with the same write sizes the journal issues
  (one record + check per write, and one 100-record batch + check per write);
* raw ``write + fsync`` per write (ops/s) with one record + check per write;
* ``QueueJournal.append`` through ``open_data_dir`` with fsync ``never``:
  one appender appending batches of 100 items, and 1/16/256 appenders
  appending one item per call;
* the same item-at-a-time shape with fsync ``always`` (each append waits for
  its fsync): items/s, MB/s, p50/p99 append latency;
* recovery: a journal of ``--recovery-bytes`` (default 1 GiB) built directly
  as sealed 100-item batches in 16 MiB segments, page cache dropped when
  possible, then ``DataDir.open`` timed (cold, then warm).

MB = 10**6 bytes. "disk MB/s" counts every byte the journal wrote (headers,
check records, segment magic); "payload MB/s" counts item data only. Ratios
against raw write bandwidth use disk bytes, since that is the byte stream the
raw baseline writes.

Usage:  .venv/bin/python bench/journal_bench.py [--quick] [--dir /tmp] [--seconds 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import trio
from benchlib import kib_field, recording

from queued.config import FsyncMode, FsyncPolicy, JournalConfig
from queued.journal import format as jf
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
MB = 1e6
SEGMENT_BYTES = 16 * MiB  # JournalConfig().journal_size
BATCH = 100
CONCURRENCY = (1, 16, 256)
T = TypeVar("T")
SIZE_NAMES = {64: "64 B", 1 * KiB: "1 KiB", 64 * KiB: "64 KiB"}


def size_name(size: int) -> str:
    return SIZE_NAMES.get(size, f"{size} B")


def record_bytes(size: int) -> int:
    return jf.PUT_HEADER_SIZE + size


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def meminfo_kib(key: str) -> int | None:
    return kib_field("/proc/meminfo", key)


def log(msg: str = "") -> None:
    print(msg, flush=True)


# -- results --------------------------------------------------------------------


@dataclass
class Row:
    figure: str
    value: str
    ratio: str = ""
    target: str = ""
    met: str = ""


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)

    def add(self, *args: str) -> None:
        self.rows.append(Row(*args))


# -- raw baselines ----------------------------------------------------------------


@dataclass
class RawWrite:
    bytes: int
    writes: int
    seconds: float
    cpu: float  # process CPU seconds (user + sys, all threads)

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / MB

    @property
    def cpu_per_gb(self) -> float:
        return self.cpu / (self.bytes / 1e9)


def raw_write(path: Path, write_size: int, total_bytes: int, max_seconds: float) -> RawWrite:
    """os.write of `write_size` chunks into 16 MiB files (O_APPEND, like the journal)."""
    buf = os.urandom(write_size)
    written = writes = 0
    fd = -1
    seg_used = SEGMENT_BYTES
    number = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    try:
        while written < total_bytes:
            if seg_used + write_size > SEGMENT_BYTES and seg_used:
                if fd >= 0:
                    os.close(fd)
                number += 1
                fd = os.open(path / f"raw.{number}",
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                seg_used = 0
            view = memoryview(buf)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            written += write_size
            seg_used += write_size
            writes += 1
            if writes % 32 == 0 and time.perf_counter() >= deadline:
                break
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
    finally:
        if fd >= 0:
            os.close(fd)
    return RawWrite(written, writes, seconds, cpu)


@dataclass
class RawFsync:
    ops: int
    seconds: float
    lat: list[float]

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


def raw_write_fsync(path: Path, write_size: int, max_ops: int, max_seconds: float) -> RawFsync:
    buf = os.urandom(write_size)
    fd = os.open(path / "rawsync", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
    lat: list[float] = []
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    try:
        now = t0
        while len(lat) < max_ops and now < deadline:
            os.write(fd, buf)
            os.fsync(fd)
            t = time.perf_counter()
            lat.append(t - now)
            now = t
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return RawFsync(len(lat), seconds, lat)


# -- journal appends --------------------------------------------------------------


@dataclass
class JournalRun:
    mode: FsyncMode
    size: int
    appenders: int
    batch: int
    items: int
    seconds: float
    disk_bytes: int
    rounds: int
    fsyncs: int
    lat: list[float]
    cpu: float  # process CPU seconds (user + sys, trio loop and writer thread)

    @property
    def cpu_per_gb(self) -> float:
        return self.cpu / (self.disk_bytes / 1e9)

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds

    @property
    def payload_mbps(self) -> float:
        return self.items * self.size / self.seconds / MB

    @property
    def disk_mbps(self) -> float:
        return self.disk_bytes / self.seconds / MB


def journal_run(
    path: Path, mode: FsyncMode, size: int, appenders: int, batch: int,
    max_seconds: float, max_bytes: int,
) -> JournalRun:
    cfg = JournalConfig(fsync=FsyncPolicy(mode))
    data = os.urandom(size)
    datas = [data] * batch
    max_items = max(batch * appenders, max_bytes // record_bytes(size))

    async def main() -> JournalRun:
        lat: list[float] = []
        started = 0
        done = 0
        async with open_data_dir(path, queue_config=lambda _: cfg) as dd:
            j = dd.queue("q")
            c0 = time.process_time()
            t0 = time.perf_counter()
            deadline = t0 + max_seconds

            async def appender() -> None:
                nonlocal started, done
                while True:
                    t = time.perf_counter()
                    if t >= deadline or started >= max_items:
                        return
                    started += batch
                    await j.append(datas, time.time_ns() // 1_000_000)
                    lat.append(time.perf_counter() - t)
                    done += batch

            async with trio.open_nursery() as nursery:
                for _ in range(appenders):
                    nursery.start_soon(appender)
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - c0
            js = j.statistics()
            ds = dd.statistics()
        return JournalRun(mode, size, appenders, batch, done, seconds, js.bytes,
                          ds.rounds, ds.fsync.count, lat, cpu)

    return trio.run(main)


# -- recovery ------------------------------------------------------------------------


@dataclass
class Built:
    items: int
    bytes: int
    segments: int
    seconds: float


def build_journal(path: Path, size: int, total_bytes: int) -> Built:
    """Sealed 100-item batches of PUTs in 16 MiB segments q.1, q.2, ...; ids 1, 2, ..."""
    t0 = time.perf_counter()
    data = os.urandom(size)
    add_ms = time.time_ns() // 1_000_000
    rec = struct.Struct(f"<Biiqq{size}s")
    if rec.pack(jf.PUT_BYTE, size, 0, 7, add_ms, data) == jf.encode_put(jf.Put(7, data, add_ms)):
        pack = rec.pack

        def encode_batch(first: int) -> bytes:
            return b"".join([pack(0x86, size, 0, i, add_ms, data)
                             for i in range(first, first + BATCH)])
    else:  # layout drifted from our fast packer: fall back to the codec itself
        log("  note: fast packer disagrees with jf.encode_put; building with encode_put (slow)")

        def encode_batch(first: int) -> bytes:
            return b"".join([jf.encode_put(jf.Put(i, data, add_ms))
                             for i in range(first, first + BATCH)])

    header = jf.WRITER_MAGIC + jf.EMPTY_CHECK
    seal = jf.seal
    batch_bytes = BATCH * record_bytes(size) + jf.CHECK_RECORD_SIZE
    per_segment = max(1, (SEGMENT_BYTES - len(header)) // batch_bytes)
    next_id = 1
    written = 0
    number = 0
    while written < total_bytes:
        parts = [header]
        seg_bytes = len(header)
        for _ in range(per_segment):
            if written + seg_bytes >= total_bytes:
                break
            sealed = seal(encode_batch(next_id), seg_bytes)
            parts.append(sealed)
            seg_bytes += len(sealed)
            next_id += BATCH
        number += 1
        with open(path / jf.segment_name("q", number), "wb") as f:
            f.write(b"".join(parts))
        written += seg_bytes
    return Built(next_id - 1, written, number, time.perf_counter() - t0)


_PROBE = """
import mmap, time
size = 64 << 20
m = mmap.mmap(-1, size)
t0 = time.perf_counter()
for off in range(0, size, 4096):
    m[off] = 1
print((time.perf_counter() - t0) / (size // 4096) * 1e6)
"""


def first_touch_us_per_page() -> float:
    """Cost of faulting in fresh anonymous memory (in a child: keeps our max RSS clean)."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return float(out.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return float("nan")


def drop_caches() -> tuple[bool, str]:
    os.sync()
    before = meminfo_kib("Cached")
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return False, f"could not drop the page cache ({exc}): WARM"
    after = meminfo_kib("Cached")
    return True, f"page cache dropped (Cached {before} -> {after} KiB): COLD"


@dataclass
class RecoveryRun:
    label: str
    records: int
    bytes: int
    seconds: float
    report_seconds: float

    @property
    def items_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / MB


def time_open(path: Path, label: str) -> RecoveryRun:
    t0 = time.perf_counter()
    dd = DataDir.open(path)
    seconds = time.perf_counter() - t0
    return RecoveryRun(label, dd.report.records, dd.report.bytes, seconds, dd.report.seconds)


# -- driver ----------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(tempfile.mkdtemp(prefix="journal-bench-", dir=args.dir))
        self.res = Results()
        self.seq = 0

    def fresh(self) -> Path:
        self.seq += 1
        p = self.root / f"m{self.seq}"
        p.mkdir()
        os.sync()  # start each measurement with no writeback pending from the last
        return p

    def done(self, p: Path) -> None:
        shutil.rmtree(p, ignore_errors=True)

    def measure(self, fn: Callable[[Path], T]) -> T:
        p = self.fresh()
        try:
            return fn(p)
        finally:
            self.done(p)

    # -- environment --------------------------------------------------------------

    def environment(self) -> None:
        a = self.args
        log("# queued journal benchmark")
        log()
        log(f"python {platform.python_version()}, {platform.system()} {platform.release()}, "
            f"{os.cpu_count()} CPUs, "
            f"MemTotal {(meminfo_kib('MemTotal') or 0) // 1024} MiB")
        log(f"temp dir {self.root}; per-measurement bound {a.seconds:g} s / "
            f"{a.max_bytes / MiB:.0f} MiB; recovery journal {a.recovery_bytes / MiB:.0f} MiB"
            + (" (--quick)" if a.quick else ""))
        df: list[str] = []
        try:
            df = subprocess.run(["df", "-P", str(self.root), "/work"], capture_output=True,
                                text=True, timeout=10).stdout.strip().splitlines()
            for line in df:
                log(f"  df: {line}")
        except (OSError, subprocess.SubprocessError):
            pass
        work = Path("/work")
        if work.exists() and os.stat(work).st_dev != os.stat(self.root).st_dev:
            self.res.caveats.append(f"{self.root} is NOT on the same filesystem as /work")
        dev = os.path.basename(df[-1].split()[0]) if len(df) > 1 else ""
        q = Path(f"/sys/block/{dev}/queue")
        if dev and q.exists():
            rot = read_text(q / "rotational")
            wc = read_text(q / "write_cache")
            log(f"  block device {dev}: rotational={rot} write_cache={wc!r} "
                f"scheduler={read_text(q / 'scheduler')}")
            if wc == "write back":
                self.res.caveats.append(
                    f"{dev} reports a volatile write-back cache and the machine is virtual: "
                    "fsync may complete in the host's cache, so fsync figures can be far "
                    "faster than on real durable storage")
        us_page = first_touch_us_per_page()
        log(f"  first touch of fresh anonymous memory: {us_page:.2f} us per 4 KiB page "
            f"(= {4096 / us_page:,.0f} MB/s ceiling for filling new pages)")
        if us_page > 1.0:
            self.res.caveats.append(
                f"first touch of a fresh memory page costs {us_page:.1f} us here (bare metal: "
                "~0.1-0.3 us; virtio-balloon free-page reporting hands freed pages back to the "
                "host). New page-cache pages and every large fresh Python buffer pay it, so "
                "copies into new buffers cost far more than memory bandwidth suggests")
        if "fc" in platform.release() or Path("/sys/hypervisor").exists():
            self.res.caveats.append(f"virtual machine (kernel {platform.release()}): "
                                    "shared host CPU and disk, expect run-to-run noise")
        if (os.cpu_count() or 0) <= 2:
            self.res.caveats.append(
                f"only {os.cpu_count()} CPUs: the trio loop, the writer thread and the kernel's "
                "writeback compete for them")
        log()

    # -- per size ----------------------------------------------------------------------

    def sizes(self, size: int) -> None:
        a = self.args
        name = size_name(size)
        rec = record_bytes(size)
        item_write = rec + jf.CHECK_RECORD_SIZE
        batch_write = BATCH * rec + jf.CHECK_RECORD_SIZE
        log(f"## item size {name} (record {rec} B, one-item write {item_write} B, "
            f"{BATCH}-item batch write {batch_write} B)")

        raw_item = self.measure(lambda p: raw_write(p, item_write, a.max_bytes, a.seconds))
        log(f"  raw os.write, {item_write} B writes: {raw_item.mbps:9.1f} MB/s "
            f"({raw_item.writes / raw_item.seconds:,.0f} writes/s, {raw_item.seconds:.2f} s)")
        # This VM's write bandwidth drifts by several x between runs, so the journal's
        # batch figure is taken as interleaved pairs (journal, then raw os.write of
        # exactly the journal's bytes in the same write size); ratios are per pair.
        pairs: list[tuple[JournalRun, RawWrite]] = []
        for _ in range(a.pairs):
            jr = self.measure(lambda p: journal_run(
                p, FsyncMode.NEVER, size, 1, BATCH, a.seconds / a.pairs, a.max_bytes))
            rw = self.measure(functools.partial(
                raw_write, write_size=batch_write, total_bytes=jr.disk_bytes,
                max_seconds=4 * a.seconds))
            pairs.append((jr, rw))
            log(f"    pair: journal {jr.disk_mbps:8.1f} MB/s ({jr.cpu_per_gb:.2f} CPU s/GB), "
                f"raw {rw.mbps:8.1f} MB/s ({rw.cpu_per_gb:.2f} CPU s/GB) over "
                f"{rw.bytes / MB:,.0f} MB: ratio {jr.disk_mbps / rw.mbps:.2f}")
        never_batch = median_by(pairs, lambda pr: pr[0].items_per_s)[0]
        raw_b = median_by(pairs, lambda pr: pr[1].mbps)[1]
        raw_batch = raw_b.mbps
        ratio_nb = statistics.median(jr.disk_mbps / rw.mbps for jr, rw in pairs)
        spread = max(rw.mbps for _, rw in pairs) / min(rw.mbps for _, rw in pairs)
        if spread > 2:
            self.res.caveats.append(
                f"{name}: raw os.write bandwidth varied {spread:.1f}x between identical runs "
                "(page-cache pages recycled vs fresh); compare the CPU-per-GB ratio too")
        cpu_ratio = statistics.median(jr.cpu_per_gb / rw.cpu_per_gb for jr, rw in pairs)
        log(f"  raw os.write, {batch_write} B writes: {raw_batch:9.1f} MB/s (median of "
            f"{len(pairs)}; {raw_b.cpu_per_gb:.2f} CPU s/GB)")
        self.print_run(never_batch, f"median ratio x{ratio_nb:.2f} of raw batch-write MB/s; "
                                    f"CPU per GB x{cpu_ratio:.1f} of raw")

        self.res.add(f"{name}: raw os.write ({item_write} B writes)",
                     f"{raw_item.mbps:,.1f} MB/s", "reference")
        self.res.add(f"{name}: raw os.write ({batch_write} B writes)",
                     f"{raw_batch:,.1f} MB/s (median of {len(pairs)}: "
                     + " / ".join(f"{rw.mbps:,.0f}" for _, rw in pairs) + ")", "reference")
        target = met = ""
        if size == 64 * KiB:
            target, met = ">= 0.70 x raw write", yes(ratio_nb >= 0.70)
        self.res.add(f"{name}: never, 1 appender x {BATCH}-item batches",
                     f"{never_batch.items_per_s:,.0f} items/s, {never_batch.disk_mbps:,.1f} MB/s",
                     f"{ratio_nb:.2f} x raw write (median of per-pair ratios "
                     + " / ".join(f"{jr.disk_mbps / rw.mbps:.2f}" for jr, rw in pairs)
                     + f"); CPU/GB {cpu_ratio:.1f} x raw", target, met)

        never_by_n: dict[int, JournalRun] = {}
        for n in CONCURRENCY:
            r = self.measure(functools.partial(
                journal_run, mode=FsyncMode.NEVER, size=size, appenders=n, batch=1,
                max_seconds=a.seconds, max_bytes=a.max_bytes))
            never_by_n[n] = r
            ratio = r.disk_mbps / raw_batch
            self.print_run(r, f"x{ratio:.2f} of raw batch-write MB/s, "
                              f"x{r.disk_mbps / raw_item.mbps:.2f} of raw item-write MB/s")
            self.res.add(f"{name}: never, {n} appenders x 1 item",
                         f"{r.items_per_s:,.0f} items/s, {r.disk_mbps:,.1f} MB/s",
                         f"{ratio:.2f} x raw write")

        # write+fsync brackets the fsync-always runs too: fsync latency here is bimodal.
        sync1 = self.measure(lambda p: raw_write_fsync(p, item_write, 1_000_000, a.seconds))
        always: list[JournalRun] = []
        for n in CONCURRENCY:
            r = self.measure(functools.partial(
                journal_run, mode=FsyncMode.ALWAYS, size=size, appenders=n, batch=1,
                max_seconds=a.seconds, max_bytes=a.max_bytes))
            always.append(r)
            same = r.items_per_s / never_by_n[n].items_per_s
            self.print_run(r, f"x{same:.2f} of never@{n}, "
                              f"x{r.items_per_s / never_batch.items_per_s:.2f} of never batch")
        sync2 = self.measure(lambda p: raw_write_fsync(p, item_write, 1_000_000, a.seconds))
        raw_sync = (sync1.ops_per_s + sync2.ops_per_s) / 2
        swing = max(sync1.ops_per_s, sync2.ops_per_s) / min(sync1.ops_per_s, sync2.ops_per_s)
        if swing > 2:
            self.res.caveats.append(
                f"{name}: raw write+fsync rate changed {swing:.1f}x between before and after "
                f"the fsync-always runs (p50 {pct(sync1.lat, 50) * 1e3:.2f} ms vs "
                f"{pct(sync2.lat, 50) * 1e3:.2f} ms): this disk's fsync latency is bimodal")
        log(f"  raw write+fsync, {item_write} B: {raw_sync:9,.0f} ops/s (before "
            f"{sync1.ops_per_s:,.0f} ops/s p50 {pct(sync1.lat, 50) * 1e6:.0f} us "
            f"p99 {pct(sync1.lat, 99) * 1e6:.0f} us; after {sync2.ops_per_s:,.0f} ops/s "
            f"p50 {pct(sync2.lat, 50) * 1e6:.0f} us p99 {pct(sync2.lat, 99) * 1e6:.0f} us)")
        self.res.add(f"{name}: raw write+fsync ({item_write} B)",
                     f"{raw_sync:,.0f} ops/s (before {sync1.ops_per_s:,.0f} / after "
                     f"{sync2.ops_per_s:,.0f}); p50 {pct(sync1.lat + sync2.lat, 50) * 1e3:.2f} ms",
                     "reference")
        for r in always:
            n = r.appenders
            same = r.items_per_s / never_by_n[n].items_per_s
            vs_batch = r.items_per_s / never_batch.items_per_s
            vs_sync = r.items_per_s / raw_sync
            value = (f"{r.items_per_s:,.0f} items/s, {r.payload_mbps:,.1f} MB/s, "
                     f"p50 {pct(r.lat, 50) * 1e3:.2f} ms, p99 {pct(r.lat, 99) * 1e3:.2f} ms")
            ratios = (f"{same:.2f} x never@{n}; {vs_batch:.2f} x never batch; "
                      f"{vs_sync:.2f} x raw w+fsync")
            if size == 1 * KiB and n == 256:
                self.res.add(f"{name}: always, {n} appenders x 1 item", value, ratios,
                             ">= 0.50 x never (same shape: 256 x 1 item)", yes(same >= 0.5))
                self.res.add(f"{name}: always, {n} appenders (vs never batch)", "(same run)",
                             f"{vs_batch:.2f} x never batch",
                             ">= 0.50 x never (stricter: vs 1 x 100-item batches)",
                             yes(vs_batch >= 0.5))
            else:
                self.res.add(f"{name}: always, {n} appenders x 1 item", value, ratios)
        log(f"  maxrss so far {maxrss_mib():.0f} MiB")
        log()

    def print_run(self, r: JournalRun, extra: str) -> None:
        shape = f"1 x {r.batch}-item batches" if r.batch > 1 else f"{r.appenders:3d} x 1 item"
        log(f"  journal {r.mode.value:6s} {shape:22s}: {r.items_per_s:10,.0f} items/s "
            f"payload {r.payload_mbps:8.1f} MB/s disk {r.disk_mbps:8.1f} MB/s "
            f"p50 {pct(r.lat, 50) * 1e3:6.2f} ms p99 {pct(r.lat, 99) * 1e3:6.2f} ms "
            f"({r.items:,} items, {r.seconds:.2f} s, {r.rounds:,} rounds, "
            f"{r.items / max(1, r.rounds):.1f} items/round, {r.fsyncs:,} fsyncs) {extra}")

    # -- recovery ------------------------------------------------------------------------

    def recovery(self, size: int) -> None:
        a = self.args
        name = size_name(size)
        p = self.fresh()
        try:
            built = build_journal(p, size, a.recovery_bytes)
            log(f"## recovery, {name} items: built {built.bytes / MiB:,.0f} MiB, "
                f"{built.items:,} items in {built.segments} segments "
                f"(sealed {BATCH}-item batches) in {built.seconds:.1f} s")
            cold, how = drop_caches()
            log(f"  {how}")
            if not cold:
                self.res.caveats.append(f"recovery {name}: {how}")
            runs = [time_open(p, "cold" if cold else "warm (drop failed)"), time_open(p, "warm")]
            for r in runs:
                note = "" if r.records == built.items else f"  (!! expected {built.items:,})"
                log(f"  DataDir.open {r.label:18s}: {r.items_per_s:12,.0f} items/s "
                    f"{r.mbps:8.1f} MB/s ({r.records:,} records, {r.bytes / MiB:,.0f} MiB "
                    f"in {r.seconds:.2f} s){note}")
                target = met = ""
                if size == 64 and r is runs[0]:
                    target = ">= 1,000,000 items/s"
                    met = yes(r.items_per_s >= 1_000_000)
                    if not cold:
                        met += " (warm cache)"
                self.res.add(f"{name}: recovery, {r.label}",
                             f"{r.items_per_s:,.0f} items/s, {r.mbps:,.1f} MB/s",
                             "", target, met)
            log(f"  maxrss so far {maxrss_mib():.0f} MiB")
            log()
        finally:
            self.done(p)

    # -- the report -----------------------------------------------------------------------

    def table(self, started: float) -> None:
        log("## summary")
        log()
        log("| figure | value | ratio | target | met? |")
        log("|---|---|---|---|---|")
        for r in self.res.rows:
            log(f"| {r.figure} | {r.value} | {r.ratio} | {r.target} | {r.met} |")
        log()
        log(f"max RSS (getrusage ru_maxrss): {maxrss_mib():.0f} MiB; "
            f"total run time {time.perf_counter() - started:.0f} s")
        if self.res.caveats:
            log()
            log("caveats:")
            for c in self.res.caveats:
                log(f"- {c}")


def median_by(items: list[T], key: Callable[[T], float]) -> T:
    return sorted(items, key=key)[len(items) // 2]


def read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def yes(ok: bool) -> str:
    return "yes" if ok else "**NO**"


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for suffix, mult in (("gib", GiB), ("mib", MiB), ("kib", KiB), ("g", GiB), ("m", MiB),
                         ("k", KiB), ("b", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp",
                    help="parent of the temp dir; must be on the disk under test (default /tmp)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="time bound per measurement (default 3, --quick 0.5)")
    ap.add_argument("--max-bytes", type=parse_size, default=None,
                    help="byte bound per append measurement (default 1GiB, --quick 64MiB)")
    ap.add_argument("--recovery-bytes", type=parse_size, default=None,
                    help="size of the recovery journal (default 1GiB, --quick 64MiB)")
    ap.add_argument("--sizes", default="64,1k,64k", help="item sizes (default 64,1k,64k)")
    ap.add_argument("--recovery-sizes", default="64,1k",
                    help="item sizes for the recovery test (default 64,1k; '' to skip)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="interleaved journal/raw pairs for the batch figure (default 3, "
                         "--quick 1)")
    ap.add_argument("--skip-appends", action="store_true", help="only run the recovery test")
    ap.add_argument("--quick", action="store_true", help="shrink everything for a smoke run")
    a = ap.parse_args()
    if a.seconds is None:
        a.seconds = 0.5 if a.quick else 3.0
    if a.pairs is None:
        a.pairs = 1 if a.quick else 3
    if a.max_bytes is None:
        a.max_bytes = 64 * MiB if a.quick else 1 * GiB
    if a.recovery_bytes is None:
        a.recovery_bytes = 64 * MiB if a.quick else 1 * GiB
    started = time.perf_counter()
    bench = Bench(a)
    try:
        bench.environment()
        sections: list[tuple[str, Callable[[], None]]] = []
        if not a.skip_appends:
            sections += [(f"appends, {s.strip()}", functools.partial(bench.sizes, parse_size(s)))
                         for s in a.sizes.split(",") if s.strip()]
        sections += [(f"recovery, {s.strip()}", functools.partial(bench.recovery, parse_size(s)))
                     for s in a.recovery_sizes.split(",") if s.strip()]
        for what, section in sections:
            try:
                section()
            except Exception as exc:  # the engine is edited concurrently: report, go on
                log(f"!! section {what} failed: {exc!r}")
                traceback.print_exc(file=sys.stdout)
                bench.res.caveats.append(f"section {what} FAILED: {exc!r}")
        bench.table(started)
    finally:
        shutil.rmtree(bench.root, ignore_errors=True)


if __name__ == "__main__":
    with recording("journal_bench"):
        main()
