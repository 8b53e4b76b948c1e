"""What a compressor's training step is made of: operators, kernel launches and host reads.

``step_profile.py`` times a step per compressor; this module says why one costs what it
does.  On a GPU a compressor's passes over 25M elements take tens of microseconds each, so
what a step pays for is mostly counted, not streamed: kernel launches (a few microseconds of
host time each), and host reads of device values — ``.item()``, ``int(t)``, ``nonzero``, a
boolean mask — each of which stalls the host until the device catches up, so the launches
after it no longer hide behind the device's work.  :func:`summarise` reads one torch
profiler run of a few steps and returns, per step:

* ``operators``: aten operators called (nested ones included: a proxy, the same for every
  compressor), and the ones the compressor adds over the dense step follow from two rows;
* ``kernels``: device kernels launched (CUDA only), and ``device_ms``, their summed time;
* ``host_reads``: ``aten::_local_scalar_dense`` (every ``.item()``/``int()``/``bool()`` of a
  tensor) and ``aten::nonzero`` calls; on CUDA, ``syncs``: the runtime's synchronising calls
  (stream, device and event synchronisation, blocking copies);
* ``top``: the operators by own time (device time on CUDA, else CPU time), with calls.

On a CPU the counts still hold (the same code issues the same operators and reads), which
is how a change to the data path is checked between GPU sessions.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

#: CUDA runtime calls that make the host wait for the device.
SYNCHRONISING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")

#: Operators that read a device value on the host.
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero")


def profile_steps(step: Callable[[], None], steps: int, device: torch.device):
    """Torch's profiler around ``steps`` calls of ``step`` (CUDA activity on a GPU)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return prof


def summarise(prof, steps: int, on_cuda: bool, top: int = 12) -> Dict[str, object]:
    """The per-step counts and top operators of a profiler run (see the module docstring)."""
    events = list(prof.key_averages())
    kernels = [e for e in events if on_cuda and _is_kernel(e)]
    operators = [e for e in events if e.key.startswith("aten::")]

    def own_ms(event) -> float:
        return (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / steps / 1e3

    def calls(names) -> float:
        return sum(e.count for e in events if any(e.key.startswith(n) for n in names)) / steps

    ranked = sorted((e for e in events if not _is_kernel(e)), key=own_ms, reverse=True)
    summary = {
        "operators": sum(e.count for e in operators) / steps,
        "host_reads": {name: sum(e.count for e in events if e.key == name) / steps for name in HOST_READS},
        "top": [{"operator": e.key, "calls": e.count / steps, "own_ms": round(own_ms(e), 3)} for e in ranked[:top]],
    }
    if on_cuda:
        summary["kernels"] = sum(e.count for e in kernels) / steps
        summary["device_ms"] = round(sum(e.self_device_time_total for e in kernels) / steps / 1e3, 3)
        summary["syncs"] = calls(SYNCHRONISING)
    return summary


def _is_kernel(event) -> bool:
    """A device kernel's own event (not the host operator that launched it)."""
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


def write_table(rows: List[dict], path: str, header: str) -> None:
    """``rows``: {model, compressor, step_ms, summary}; one line per step, then each step's
    top operators."""
    on_cuda = any("kernels" in r["summary"] for r in rows)
    with open(path, "w") as f:
        f.write(header + "\n\n| model | compressor | step ms | operators | "
                + ("kernels | device ms | syncs | " if on_cuda else "")
                + "item() reads | nonzero |\n|---|---|---:|---:|" + ("---:|---:|---:|" if on_cuda else "") + "---:|---:|\n")
        for row in rows:
            s = row["summary"]
            f.write(f"| {row['model']} | {row['compressor']} | {row.get('step_ms', float('nan')):.1f} | "
                    f"{s['operators']:.0f} | "
                    + (f"{s['kernels']:.0f} | {s['device_ms']:.1f} | {s['syncs']:.0f} | " if on_cuda else "")
                    + f"{s['host_reads']['aten::_local_scalar_dense']:.0f} | {s['host_reads']['aten::nonzero']:.0f} |\n")
        where = "device" if on_cuda else "CPU"
        for row in rows:
            f.write(f"\n### {row['model']}, {row['compressor']}: operators by own {where} time per step\n\n"
                    f"| operator | calls per step | own ms |\n|---|---:|---:|\n")
            for op in row["summary"]["top"]:
                f.write(f"| `{op['operator']}` | {op['calls']:g} | {op['own_ms']:.3f} |\n")
