#!/usr/bin/env python
"""The scheduler benchmark's table: ``auto`` vs the best fixed fusion-num vs ``binary``.

    python benchmarks/scheduler_report.py benchmarks/results/<dir>/results.jsonl [more.jsonl ...]

For every model, profile and compressor: the throughput of each fixed fusion-num cell, the
best of them, ``binary`` and ``auto`` (with the groups it chose, how many are compressed,
and the search cost in steps), and the ratios auto / best fixed and auto / binary.  When a
DDP FP32 cell of the same model and profile is present, auto / DDP FP32 too — on a fast
link that is the check that auto declines compression when it does not pay.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sweep import latest, read_records  # noqa: E402


def table(records: List[dict]) -> str:
    ok = [r for r in latest(records).values() if r["status"] == "ok"]
    ddp: Dict[tuple, float] = {}
    cells: Dict[tuple, dict] = defaultdict(lambda: {"fixed": {}})
    for r in ok:
        cell, rate = r["cell"], r["result"]["rate_total"]
        place = (cell["model"], cell.get("profile"), cell.get("workers"))
        if cell["kind"] == "ddp" and cell["hook"] == "fp32":
            ddp[place] = rate
        if cell["kind"] != "mergecomp":
            continue
        row = cells[place + (cell["compressor"],)]
        scheduler = cell.get("scheduler", "fixed")
        if scheduler == "fixed":
            row["fixed"][cell["fusion_num"]] = rate
        else:
            row[scheduler] = r["result"]
    lines = ["| model | link | compressor | best fixed (fusion-num) | binary | auto | auto groups (compressed) | "
             "search steps | auto / best fixed | auto / binary | auto / DDP FP32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, profile, workers, compressor), row in sorted(cells.items()):
        best = max(row["fixed"].items(), key=lambda kv: kv[1]) if row["fixed"] else None
        auto, binary = row.get("auto"), row.get("binary")
        fp32 = ddp.get((model, profile, workers))

        def ratio(a, b):
            return f"{a / b:.3f}" if a and b else "—"

        auto_rate = auto["rate_total"] if auto else None
        binary_rate = binary["rate_total"] if binary else None
        cells_text = [
            f"{best[1]:.1f} ({best[0]})" if best else "—",
            f"{binary_rate:.1f}" if binary else "—",
            f"{auto_rate:.1f}" if auto else "—",
            f"{auto['groups']} ({auto['compressed_groups']})" if auto else "—",
            str(auto.get("search_steps", "—")) if auto else "—",
            ratio(auto_rate, best[1] if best else None), ratio(auto_rate, binary_rate),
            ratio(auto_rate, fp32)]
        lines.append(f"| {model} | {profile} ×{workers} | {compressor} | " + " | ".join(cells_text) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.jsonl files written by benchmarks/sweep.py")
    args = p.parse_args(argv)
    records = []
    for path in args.results:
        if not os.path.exists(path):
            p.error(f"no such results file: {path}")
        records += read_records(path)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
