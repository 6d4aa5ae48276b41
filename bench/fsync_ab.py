"""Two queued trees side by side under fsync never and always: vs_darner.py's workloads,
run after run alternating between the trees, then the medians and the always/never ratio
of each tree in one table. Prints numbers, never asserts.

    .venv/bin/python bench/fsync_ab.py --before /work/main --after . --runs 3
    .venv/bin/python bench/fsync_ab.py --before /work/main --after . --workloads drain --runs 1

Each run is one `vs_darner.py --runs 1` per tree (targets queued-never and queued-always,
no darner), the tree put first on PYTHONPATH of the `queued` beside this Python; the trees
alternate which goes first. Their JSON files go to a temp dir; the table (and a JSON of
it) to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
QUEUED = Path(sys.executable).with_name("queued")
SERVE = ("serve --data-dir {data_dir} --host 127.0.0.1 --memcache-port {memcache_port} "
         "--text-port {text_port} --rpc-port {rpc_port} --http-port {http_port} "
         "--fsync {fsync}")


def commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "queued"],
                           capture_output=True, text=True, check=False).stdout.strip()
    if out.returncode != 0:  # not a checkout (an exported tree, say): its folder's name
        return tree.name
    return (out.stdout.strip() or "?") + ("+dirty" if dirty else "")


def one_run(tree: Path, a: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    cmd = f"env PYTHONPATH={shlex.quote(str(tree))} {shlex.quote(str(QUEUED))} {SERVE}"
    before = set(out_dir.glob("*.json"))
    subprocess.run([sys.executable, str(HERE / "vs_darner.py"), "--runs", "1",
                    "--targets", "queued-never,queued-always", "--workloads", a.workloads,
                    "--wait-idle", str(a.wait_idle), "--wait-budget", str(a.wait_budget),
                    "--scale", str(a.scale),
                    "--queued-cmd", cmd, "--queued-tree", str(tree),
                    "--out-dir", str(out_dir)], check=True, stdout=subprocess.DEVNULL)
    [new] = set(out_dir.glob("*.json")) - before
    rows: list[dict[str, Any]] = json.loads(new.read_text())["rows"]
    new.rename(new.with_suffix(f".{time.monotonic_ns()}.done"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the tree measured first")
    ap.add_argument("--after", type=Path, required=True, help="the tree it is compared to")
    ap.add_argument("--runs", type=int, default=3, help="runs per tree (default 3)")
    ap.add_argument("--workloads", default="drain,steady,fanin",
                    help="vs_darner.py workloads (default drain,steady,fanin)")
    ap.add_argument("--wait-idle", type=float, default=10.0,
                    help="vs_darner.py --wait-idle per cell (default 10 s)")
    ap.add_argument("--wait-budget", type=float, default=60.0,
                    help="vs_darner.py --wait-budget per run (default 60 s)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="vs_darner.py --scale: multiply every item count (default 1)")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    a = ap.parse_args()
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    commits = {name: commit(tree) for name, tree in trees.items()}
    rows: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    started = time.strftime("%Y%m%d-%H%M")
    with tempfile.TemporaryDirectory(prefix="fsync-ab-") as tmp:
        for run in range(a.runs):
            order = ["before", "after"] if run % 2 == 0 else ["after", "before"]
            for name in order:
                print(f"run {run + 1}/{a.runs}: {name} ({commits[name]})", file=sys.stderr,
                      flush=True)
                rows[name] += one_run(trees[name], a, Path(tmp))
    cells: dict[tuple[str, int, str], dict[str, dict[str, float]]] = {}
    for name, rs in rows.items():
        groups: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
        for r in rs:
            groups.setdefault((r["workload"], r["payload"], r["op"], r["target"]), []).append(r)
        for (w, p, op, target), g in groups.items():
            fsync = target.removeprefix("queued-")
            cell = cells.setdefault((w, p, op), {})
            cell[f"{name} {fsync}"] = median(r["items_per_s"] for r in g)
            cell[f"{name} {fsync} cpu"] = median(
                1e6 / r["items_per_cpu_s"] for r in g if r["items_per_cpu_s"])
            cell[f"{name} {fsync} runs"] = len(g)
    lines = [
        f"fsync never vs always, before `{commits['before']}` ({trees['before']}) and after "
        f"`{commits['after']}` ({trees['after']}); medians of {a.runs} runs, alternating; "
        "CPU = server CPU us per item",
        "",
        "| workload | payload | op | before never | before always | before always/never "
        "| after never | after always | after always/never | after/before (always) "
        "| CPU before never / always | CPU after never / always |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for (w, p, op), c in sorted(cells.items()):
        def get(k: str, c: dict[str, float] = c) -> float:
            return c.get(k, float("nan"))
        lines.append(
            f"| {w} | {p} | {op} | {get('before never'):,.0f} | {get('before always'):,.0f} "
            f"| {get('before always') / get('before never'):.2f} | {get('after never'):,.0f} "
            f"| {get('after always'):,.0f} | {get('after always') / get('after never'):.2f} "
            f"| {get('after always') / get('before always'):.2f} "
            f"| {get('before never cpu'):.1f} / {get('before always cpu'):.1f} "
            f"| {get('after never cpu'):.1f} / {get('after always cpu'):.1f} |")
    table = "\n".join(lines)
    print(table)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    stem = a.out_dir / f"fsync_ab-{started}-{commits['after']}"
    stem.with_suffix(".md").write_text(table + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"commits": commits, "trees": {k: str(v) for k, v in trees.items()},
         "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    print(f"written to {stem}.md and .json", file=sys.stderr)


if __name__ == "__main__":
    main()
