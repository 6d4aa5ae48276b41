#!/usr/bin/env python3
"""Before/after of rpc_bench: runs it alternately on another source tree (server and clients,
`--queued-tree DIR --tree-clients`) and on this one, `--runs` times each, and prints the
median of every cell with its TLS / plaintext ratio and CPU per item (give rpc_bench
`--pairs N` for ratios of cells measured seconds apart).

The machine may be shared: the two sides alternate (before, after, after, before, ...) so that
a load that comes and goes falls on both, and medians leave out a run that caught a burst.
Prints numbers, never asserts.

Usage:  .venv/bin/python bench/rpc_ab.py --before /path/to/main [--runs 3] [--out DIR] \\
            -- --tls both --fsync never,always --sizes 64,1k --batches 100 --conns 4 --tasks 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SIZE_NAMES = {64: "64 B", 1024: "1 KiB"}

Key = tuple[str, int, int, int, str]  # fsync, size, batch, conns, op


def log(msg: str = "") -> None:
    print(msg, flush=True)


def run_one(side: str, before: Path, args: list[str], out: Path, n: int) -> dict[str, Any]:
    stem = out / f"{side}-{n}"
    cmd = [sys.executable, str(HERE / "rpc_bench.py"), *args, "--json", f"{stem}.json"]
    if side == "before":
        cmd += ["--queued-tree", str(before), "--tree-clients"]
    t0 = time.monotonic()
    with open(f"{stem}.txt", "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    log(f"  {side} run {n}: {time.monotonic() - t0:.0f} s -> {stem}.txt")
    try:
        result: dict[str, Any] = json.loads(Path(f"{stem}.json").read_text())
    except (OSError, ValueError) as exc:
        log(f"  !! {side} run {n} wrote no results ({exc}); see {stem}.txt")
        return {"rows": []}
    return result


def cells(results: list[dict[str, Any]]) -> dict[tuple[Key, bool], dict[str, float]]:
    """Median items/s and CPU per item of every (cell, tls) over the runs."""
    by: dict[tuple[Key, bool], list[dict[str, Any]]] = {}
    for res in results:
        for r in res["rows"]:
            key = (r["fsync"], r["size"], r["batch"], r["conns"], r["op"])
            by.setdefault((key, r["tls"]), []).append(r)
    return {k: {"items_per_s": statistics.median(r["items_per_s"] for r in rows),
                "server_us": statistics.median(r.get("server_us", 0.0) for r in rows),
                "client_us": statistics.median(r.get("client_us", 0.0) for r in rows),
                "runs": len(rows)}
            for k, rows in by.items()}


def run_ratios(results: list[dict[str, Any]]) -> dict[Key, list[float]]:
    """The TLS / plaintext ratios per cell: each pair's with rpc_bench's `--pairs`, else
    each run's."""
    out: dict[Key, list[float]] = {}
    for res in results:
        for t in res.get("tls_ratios", []):
            key = (t["fsync"], t["size"], t["batch"], t["conns"], t["op"])
            out.setdefault(key, []).extend(t.get("pair_ratios", [t["ratio"]]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True,
                    help="the other queued source tree (e.g. a checkout of main)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each side (default 3)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where each run's output and JSON go (default a temp dir)")
    ap.add_argument("--json", metavar="FILE", help="also write the medians as JSON")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER,
                    help="after --: rpc_bench.py's arguments")
    a = ap.parse_args()
    args = [x for x in a.bench_args if x != "--"]
    out = a.out or Path(tempfile.mkdtemp(prefix="rpc-ab-"))
    out.mkdir(parents=True, exist_ok=True)
    log(f"# rpc_ab: before = {a.before}, after = {HERE.parent}; {a.runs} runs each; "
        f"rpc_bench {' '.join(args)}; output in {out}")
    results: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for n in range(1, a.runs + 1):
        order = ("before", "after") if n % 2 else ("after", "before")
        for side in order:
            results[side].append(run_one(side, a.before, args, out, n))
    med = {side: cells(rs) for side, rs in results.items()}
    per_run = {side: run_ratios(rs) for side, rs in results.items()}
    keys = sorted({k for m in med.values() for (k, _) in m})
    log()
    log(f"## medians of {a.runs} runs: items/s, server and clients CPU per item (us)")
    log()
    log("| fsync | size | batch | conns | op | side | plain items/s | TLS items/s | "
        "median ratio | ratios (pairs, or runs) | server us/item plain / TLS | "
        "clients us/item plain / TLS |")
    log("|---|---|---:|---:|---|---|---:|---:|---:|---|---:|---:|")
    table = []
    for key in keys:
        fsync, size, batch, conns, op = key
        for side in ("before", "after"):
            plain, tls = med[side].get((key, False)), med[side].get((key, True))
            if plain is None or tls is None:
                continue
            runs = per_run[side].get(key, [])
            ratio = statistics.median(runs) if runs else 0.0
            table.append({"fsync": fsync, "size": size, "batch": batch, "conns": conns,
                          "op": op, "side": side, "plain": plain, "tls": tls,
                          "median_ratio": ratio, "ratios": runs})
            log(f"| {fsync} | {SIZE_NAMES.get(size, f'{size} B')} | {batch} | {conns} | {op} | "
                f"{side} | {plain['items_per_s']:,.0f} | {tls['items_per_s']:,.0f} | "
                f"{ratio:.2f} | {' '.join(f'{r:.2f}' for r in runs)} | "
                f"{plain['server_us']:.2f} / {tls['server_us']:.2f} | "
                f"{plain['client_us']:.2f} / {tls['client_us']:.2f} |")
    log()
    if a.json:
        Path(a.json).write_text(json.dumps({"args": args, "before": str(a.before),
                                            "runs": a.runs, "table": table,
                                            "results": results}, indent=2) + "\n")
        log(f"wrote {a.json}")


if __name__ == "__main__":
    main()
