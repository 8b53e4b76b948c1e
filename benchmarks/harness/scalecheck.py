"""The cells of the simulator's check at 8 to 32 workers, and the tables they make.

A *cell* is one run of ``simulator.py rounds`` in the emulated cluster: a replayed model
(:mod:`benchmarks.harness.replay`), a node layout (M nodes of L workers), and one
compressor with the plans it is timed under.  The links are slowed so that a cell
emulates a GPU cluster on a ``link_gbit`` network, with every worker's bytes and times
rescaled:

* the model's tensors shrunk by ``shrink`` (first dimensions), so that 32 copies of it
  fit one host's memory, and the links slowed by the same factor: each transfer lasts
  what the full tensor's would on the full link;
* every replayed duration (compute, codecs) multiplied by ``time_scale`` and the links
  slowed by it again: the whole step runs ``time_scale`` times slower than on the GPU
  cluster, so the host's own per-step work (hooks, packing, the kernel's network stack)
  shrinks against it by that factor.

So a cell's link is ``link_gbit / (shrink · time_scale)`` Gbit/s per node, and a step
measured there, divided by ``time_scale``, is the emulated cluster's step; predicted and
measured are compared as they are, on the same time scale.  The host-bound indicator
(:mod:`benchmarks.harness.hostload`) refuses the plans the host set.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from . import hostload

#: The traces the campaign replays: how ``benchmarks/replay.py record`` makes each, and how
#: far it is shrunk.  GPT-2 small's dimensions on the harness's transformer (its head is
#: not tied to the embedding: 163M parameters); the compute times are assumptions of one
#: V100-class GPU: ResNet-50 at batch 64 (``simulator.py scaling``'s 0.2 s) and GPT-2
#: small at 8 sequences of 1024 tokens (6 · 124M · 8192 FLOP at about 25 TFLOP/s: 0.25 s).
TRACES = {
    "resnet50": {"record": ["--model", "resnet50", "--batch-size", "8", "--batch-option", "image_size=128",
                            "--steps", "3", "--compute-time", "0.2"], "shrink": 16},
    "gpt2": {"record": ["--model", "transformer", "--name", "gpt2-small-like",
                        "--model-option", "vocab_size=50257", "--model-option", "d_model=768",
                        "--model-option", "num_heads=12", "--model-option", "num_layers=12",
                        "--model-option", "max_seq_len=1024", "--batch-option", "seq_len=256",
                        "--batch-option", "vocab_size=50257", "--batch-size", "1", "--steps", "3",
                        "--compute-time", "0.25"], "shrink": 32},
}
#: The tables: which layouts (nodes, workers per node) each one runs.
TABLES = {
    "simulator": [(8, 1), (16, 1), (32, 1), (2, 4), (4, 4), (4, 8)],
    "claims": [(16, 1), (32, 1), (4, 4)],
}
GROUPS = 4  # groups of the fixed plans, balanced by bytes


@dataclass(frozen=True)
class Cell:
    """One run: ``model`` (a key of :data:`TRACES`) on ``nodes`` × ``local`` workers, with
    ``compressor`` (``topk`` times every plan, ``powersgd`` its own)."""

    model: str
    nodes: int
    local: int
    compressor: str

    @property
    def workers(self) -> int:
        return self.nodes * self.local

    @property
    def name(self) -> str:
        layout = f"{self.workers}" if self.local == 1 else f"{self.nodes}x{self.local}"
        return f"{self.model}-{self.compressor}-{layout}"

    def plans(self) -> str:
        """The plans this cell times (``simulator.py rounds --plans``)."""
        k = GROUPS
        if self.compressor == "powersgd":
            return f"fp32-{k},compress-{k}"
        flat = [f"fp32-{k}", f"fp16-{k}", f"compress:allgather-{k}", f"compress:sparse_allreduce-{k}"]
        if self.local > 1:
            flat.append(f"compress-{k}")  # the job's communicator: hierarchical
        return ",".join(flat + ["optimal", "auto"])

    def communicator(self) -> str:
        if self.compressor == "powersgd":
            return "allreduce"
        return "hierarchical" if self.local > 1 else "allgather"


def cells(table: str, models: Sequence[str] = tuple(TRACES),
          layouts: Optional[Sequence[Tuple[int, int]]] = None) -> List[Cell]:
    """The cells of ``table`` for ``models``; ``layouts`` (nodes, workers per node) replace
    the table's own (a smoke run at a small scale)."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; the tables are {', '.join(TABLES)}")
    unknown = [m for m in models if m not in TRACES]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; the campaign's models are {', '.join(TRACES)}")
    compressors = ("topk", "powersgd") if table == "simulator" else ("topk",)
    return [Cell(m, n, l, c) for m in models for n, l in (layouts or TABLES[table]) for c in compressors]


def parse_layouts(text: str) -> List[Tuple[int, int]]:
    """``8,2x4`` → [(8, 1), (2, 4)]: flat worker counts or NODESxWORKERS."""
    layouts = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        nodes, cross, local = item.partition("x")
        if not nodes.isdigit() or (cross and not local.isdigit()) or int(nodes) * int(local or 1) < 2:
            raise ValueError(f"--layouts: {item!r} is neither a worker count nor NODESxWORKERS (e.g. 8 or "
                             "2x4) of at least 2 workers")
        layouts.append((int(nodes), int(local or 1)))
    if not layouts:
        raise ValueError(f"--layouts names no layout: {text!r}")
    return layouts


def link_spec(link_gbit: float, shrink: int, time_scale: float) -> str:
    """The cluster's ``--profile``: ``link_gbit`` slowed by ``shrink`` · ``time_scale``."""
    kbit = link_gbit * 1e6 / (shrink * time_scale)
    if kbit < 8:
        raise ValueError(f"a {link_gbit:g} Gbit/s link slowed by {shrink} × {time_scale:g} is {kbit:.1f} kbit/s: "
                         "too slow to shape; lower the shrink or the time scale")
    return f"rate={kbit:.0f}kbit"


def command(cell: Cell, trace: str, out: str, python: str, link_gbit: float, time_scale: float,
            codecs: str, rounds: int, window: int, timeout_s: float) -> List[str]:
    """The command line of one cell, run from the repository's root: ``cluster.py`` around
    ``simulator.py rounds`` (paths as given: relative ones keep a saved command portable)."""
    shrink = TRACES[cell.model]["shrink"]
    return [python, os.path.join("benchmarks", "cluster.py"), "--nodes", str(cell.nodes),
            "--workers-per-node", str(cell.local), "--profile", link_spec(link_gbit, shrink, time_scale),
            "--timeout", f"{timeout_s:g}", "--",
            python, os.path.join("benchmarks", "simulator.py"), "rounds", "--replay", trace,
            "--replay-shrink", str(shrink), "--replay-time-scale", f"{time_scale:g}", "--replay-codecs", codecs,
            "--threads", "1", "--timeout", "900", "--num-warmup-batches", "2", "--compress",
            "--compressor", cell.compressor, *(["--compress-ratio", "0.01"] if cell.compressor == "topk" else []),
            "--comm", cell.communicator(), "--plans", cell.plans(), "--rounds", str(rounds),
            "--window", str(window), "--json", os.path.join(out, f"{cell.name}.json")]


# ------------------------------------------------------------------------------ tables --

def load(folder: str) -> Dict[str, dict]:
    """{cell name: its ``simulator.py rounds`` result} of every cell saved in ``folder``."""
    results = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json") and name != "manifest.json" and not name.startswith("cells"):
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
            if isinstance(data, dict) and "plans" in data:
                results[name[:-len(".json")]] = data
    if not results:
        raise ValueError(f"{folder} holds no cell results (simulator.py rounds --json files); run "
                         "benchmarks/scale_check.py run first")
    return results


def _layout(result: dict) -> str:
    local = result.get("workers_per_node", 1)
    return f"{result['workers']}" if local == 1 else f"{result['workers'] // local}×{local}"


def simulator_table(results: Dict[str, dict], max_core_wait: float = hostload.MAX_CORE_WAIT,
                    tolerance: float = 0.15) -> str:
    """Predicted against measured step time, every plan of every cell; host-bound plans refused."""
    lines = ["| model | workers | compressor | plan | measured ms | predicted ms | error | core wait | verdict |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    checked = within = refused = 0
    for name, r in sorted(results.items(), key=lambda kv: (kv[1]["model"], kv[1]["workers"],
                                                         kv[1].get("workers_per_node", 1), kv[1]["compressor"])):
        for label, row in r["plans"].items():
            why = hostload.host_bound(row.get("host"), max_core_wait)
            measured, predicted = statistics.median(row["measured_s"]), statistics.median(row["predicted_s"])
            if why:
                refused += 1
                verdict = "refused: host-bound" if row.get("host") else "refused: not measured"
            else:
                checked += 1
                ok = abs(row["error"]) <= tolerance
                within += ok
                verdict = "within" if ok else "MISSED"
            wait = row.get("host", {}).get("core_wait") if row.get("host") else None
            lines.append(f"| {r['model']} | {_layout(r)} | {r['compressor']} | {label} | {measured * 1e3:.0f} | "
                         f"{predicted * 1e3:.0f} | {row['error']:+.1%} | "
                         f"{'–' if wait is None else f'{wait:.3f}'} | {verdict} |")
    lines.append("")
    lines.append(f"{checked} plan-cells checked ({within} within {tolerance:.0%}), {refused} refused as host-bound "
                 f"(a worker's threads waited ≥ {max_core_wait:g} s per second for a core).")
    return "\n".join(lines)


FIXED = ("fp32", "fp16", "compress:allgather", "compress:sparse_allreduce", "compress")


def claims_table(results: Dict[str, dict], max_core_wait: float = hostload.MAX_CORE_WAIT,
                 slack: float = 0.05) -> str:
    """Per top-k cell: each fixed plan's measured step, the sparse allreduce against the
    allgather, hierarchical against flat, and whether ``auto`` and ``optimal`` ran within
    ``slack`` of the fastest fixed plan.  A host-bound plan shows as refused."""
    lines = ["| model | workers | FP32 ms | FP16 ms | top-k allgather ms | top-k sparse allreduce ms | "
             "hierarchical ms | sparse / allgather | hierarchical / flat | fastest | auto ms | optimal ms | "
             "auto picks it | optimal picks it |", "|---|---|" + "---:|" * 10 + "---|---|"]
    for name, r in sorted(results.items(), key=lambda kv: (kv[1]["model"], kv[1]["workers"],
                                                         kv[1].get("workers_per_node", 1))):
        if r["compressor"] != "topk":
            continue
        times: Dict[str, Optional[float]] = {}
        for label, row in r["plans"].items():
            kind = label if label in ("auto", "optimal") else label.rsplit("-", 1)[0]
            if kind == "compress" and r.get("communicator") != "hierarchical":
                kind = f"compress:{r.get('communicator')}"  # the job's own flat communicator
            bound = hostload.host_bound(row.get("host"), max_core_wait)
            times[kind] = None if bound else statistics.median(row["measured_s"])

        def ms(kind):
            if kind not in times:
                return "–"
            return "host-bound" if times[kind] is None else f"{times[kind] * 1e3:.0f}"

        def ratio(a, b):
            return f"{times[a] / times[b]:.2f}" if times.get(a) and times.get(b) else "–"

        fixed = {k: t for k, t in times.items() if k in FIXED and t is not None}
        fastest = min(fixed, key=fixed.get) if fixed else None

        def picks(kind):
            if fastest is None or times.get(kind) is None:
                return "–"
            return "yes" if times[kind] <= (1 + slack) * fixed[fastest] else f"no (+{times[kind] / fixed[fastest] - 1:.0%})"

        lines.append(f"| {r['model']} | {_layout(r)} | {ms('fp32')} | {ms('fp16')} | {ms('compress:allgather')} | "
                     f"{ms('compress:sparse_allreduce')} | {ms('compress')} | "
                     f"{ratio('compress:sparse_allreduce', 'compress:allgather')} | {ratio('compress', 'compress:allgather')} | "
                     f"{fastest or '–'} | {ms('auto')} | {ms('optimal')} | {picks('auto')} | {picks('optimal')} |")
    lines.append("")
    lines.append(f"'picks it': within {slack:.0%} of the fastest fixed plan measured in the same rounds. "
                 "Hierarchical runs at layouts of several workers per node only.")
    return "\n".join(lines)

