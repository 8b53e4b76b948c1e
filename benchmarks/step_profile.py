#!/usr/bin/env python
"""What each compressor costs in a training step: one process (world size 1), bf16 autocast.

Two models of the sizes that matter: a ResNet-50 (bottleneck blocks 3-4-6-3, 25.6M
parameters, 224×224 images) and a GPT-2 small (12 layers of width 768, 12 heads, 50,257
tokens, 124M parameters, 1,024-token sequences).  Both are defined here, a few dozen
lines each, so this script needs nothing beyond torch and mergecomp.  For each model,
``mergecomp.DistributedOptimizer`` wraps plain SGD with each compressor (its recommended
memory and communicator, the default schedule) and a step — forward, backward with the
exchange, optimizer step — is timed after warm-up steps, alternating with the steps of a
dense twin of the model (the same architecture with ``none``), so each compressor has its
own baseline measured in the same seconds; a compressor's share of its step is (its step −
its dense twin's step) / its step.  The ``none`` row, the dense step against its twin, shows
the noise the method leaves.
At world size 1 the collectives move nothing over a network: what is left is the
compressors' own work and the data path around it.

    python benchmarks/step_profile.py --device cuda --out results/     # step-profile.json, .md
    python benchmarks/step_profile.py --device cpu --tiny --out build/profile   # a rehearsal

Each compressor gets at most ``--per-compressor-s`` seconds (a first step slower than that
ends its row), and the whole run ``--budget-s``: rows not reached are listed as such.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402
import step_operators  # noqa: E402
from mergecomp import compressors  # noqa: E402
from mergecomp.kernels import triton as gpu_kernels  # noqa: E402
from mergecomp.distributed import launch  # noqa: E402


class Bottleneck(nn.Module):
    """ResNet's 1×1 → 3×3 → 1×1 block with a projection shortcut where the shape changes."""

    def __init__(self, inputs: int, width: int, stride: int):
        super().__init__()
        outputs = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


def resnet(blocks=(3, 4, 6, 3), base: int = 64, classes: int = 1000) -> nn.Module:
    """ResNet-50 with the defaults (He et al. 2016, table 1)."""
    layers = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    inputs = base
    for stage, count in enumerate(blocks):
        width = base * 2 ** stage
        for index in range(count):
            layers.append(Bottleneck(inputs, width, 2 if index == 0 and stage > 0 else 1))
            inputs = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4× GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """GPT-2 (Radford et al. 2019) with the small model's defaults; the output layer shares
    the token embedding."""

    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50_257, context: int = 1024):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.T


def workloads(tiny: bool) -> Dict[str, Tuple[Callable[[], nn.Module], Callable[[torch.device], tuple]]]:
    """name → (model factory, batch factory (inputs, loss function of the output))."""
    def images(batch, size, classes):
        def make(device):
            generator = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(batch, 3, size, size, device=device, generator=generator)
            y = torch.randint(0, classes, (batch,), device=device, generator=generator)
            return x, lambda out: F.cross_entropy(out.float(), y)
        return make

    def text(batch, length, vocab):
        def make(device):
            generator = torch.Generator(device=device).manual_seed(0)
            tokens = torch.randint(0, vocab, (batch, length + 1), device=device, generator=generator)
            return tokens[:, :-1], lambda out: F.cross_entropy(out.float().flatten(0, 1), tokens[:, 1:].flatten())
        return make

    if tiny:
        return {"resnet-tiny": (lambda: resnet((1, 1, 1, 1), base=4, classes=10), images(2, 32, 10)),
                "gpt-tiny": (lambda: GPT(layers=2, width=32, heads=2, vocab=128, context=16), text(2, 16, 128))}
    return {"resnet50": (resnet, images(64, 224, 1000)),
            "gpt2-small": (GPT, text(8, 1024, 50_257))}


#: Options that keep a compressor quiet at world size 1 without changing its work.
OPTIONS = {"dgc": {"warmup": 0}}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One model, its batch and a ``DistributedOptimizer`` around plain SGD: ``step()`` is one
    training step (forward under bf16 autocast, backward with the exchange, the update)."""

    def __init__(self, model: nn.Module, inputs, loss_of, compressor: str, device: torch.device):
        self.model, self.inputs, self.loss_of, self.device = model, inputs, loss_of, device
        self.loss = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # recipe advice for training runs: not a timing
            self.optimizer = mergecomp.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=1e-4), model=model,
                compressor=compressors.create(compressor, **OPTIONS.get(compressor, {})))

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss_of(self.model(self.inputs))
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.optimizer.step()
        self.loss = loss.detach()

    def timed_step(self) -> float:
        """One step between two device synchronisations, in milliseconds."""
        _synchronize(self.device)
        begin = time.perf_counter()
        self.step()
        _synchronize(self.device)
        return (time.perf_counter() - begin) * 1e3

    def close(self) -> None:
        self.optimizer.remove_hooks()


def profile_model(name: str, make_model, make_batch, device: torch.device, names: List[str], steps: int,
                  warmup: int, per_compressor_s: float, deadline: float, operators: int = 0,
                  operator_names: Tuple[str, ...] = (), operator_rows: Optional[List[dict]] = None) -> List[dict]:
    """One row per compressor: the median step time against the dense step's, or why there
    is none.

    Each compressor is timed against a dense twin of the model (the same architecture, its
    own ``DistributedOptimizer`` with ``none``) in alternating steps — dense, compressed,
    compressed, dense, … — so that both medians come from the same seconds of the GPU's
    clocks and the host's load; a row's ``dense_ms`` is its own pair's.  The ``none`` row is
    the dense step against its twin: its ratio shows what the method cannot resolve.  For
    the compressors in ``operator_names``, ``operators`` more steps run under torch's
    profiler and their summary (``step_operators.summarise``) is appended to
    ``operator_rows``."""
    reference = Trainer(make_model().to(device), *make_batch(device), "none", device)
    model = make_model().to(device)
    inputs, loss_of = make_batch(device)
    parameters = sum(p.numel() for p in model.parameters())
    rows = []
    for compressor in names:
        row = {"model": name, "parameters": parameters, "compressor": compressor}
        rows.append(row)
        if time.perf_counter() > deadline:
            row["note"] = "not reached: time budget spent"
            continue
        trainer = None
        try:
            trainer = Trainer(model, inputs, loss_of, compressor, device)
            times, dense_times = [], []
            started = time.perf_counter()
            for step in range(warmup + steps):
                pair = (reference, trainer) if step % 2 == 0 else (trainer, reference)
                measured = {id(t): t.timed_step() for t in pair}
                if step >= warmup:
                    times.append(measured[id(trainer)])
                    dense_times.append(measured[id(reference)])
                if time.perf_counter() - started > per_compressor_s:
                    row["note"] = f"stopped after {step + 1} steps: over {per_compressor_s:g} s"
                    break
            if times:
                row["step_ms"] = statistics.median(times)
                row["dense_ms"] = statistics.median(dense_times)
                row["steps_timed"] = len(times)
                row["share"] = (row["step_ms"] - row["dense_ms"]) / row["step_ms"]
            if not math.isfinite(float(trainer.loss)):
                row["note"] = "the loss is not finite"
            if operators and compressor in operator_names and operator_rows is not None and times:
                prof = step_operators.profile_steps(trainer.step, operators, device)
                operator_rows.append({"model": name, "compressor": compressor, "step_ms": row["step_ms"],
                                      "summary": step_operators.summarise(prof, operators, device.type == "cuda")})
        except Exception as error:  # recorded; the next compressor runs
            row["error"] = f"{type(error).__name__}: {error}"
        finally:
            if trainer is not None:
                trainer.close()
        print(json.dumps(row), flush=True)
    reference.close()
    return rows


def write_table(rows: List[dict], path: str, header: str) -> None:
    with open(path, "w") as f:
        f.write(header + "\n\n| model | parameters | compressor | step ms | dense step ms | × dense "
                "| share of the step | note |\n")
        f.write("|---|---:|---|---:|---:|---:|---:|---|\n")
        for row in rows:
            ms, dense = row.get("step_ms"), row.get("dense_ms")
            ratio = f"{ms / dense:.2f}" if ms and dense else ""
            share = f"{100 * row['share']:.0f}%" if "share" in row else ""
            note = row.get("error") or row.get("note", "")
            f.write(f"| {row['model']} | {row['parameters']:,} | {row['compressor']} | "
                    f"{'' if ms is None else f'{ms:.1f}'} | {'' if dense is None else f'{dense:.1f}'} | "
                    f"{ratio} | {share} | {note} |\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (NCCL, 1 rank) or cpu (gloo)")
    parser.add_argument("--tiny", action="store_true", help="tiny models: a rehearsal of the code path")
    parser.add_argument("--models", default=None, help="comma-separated models (default both)")
    parser.add_argument("--compressors", default=None, help="comma-separated (default: every registered one)")
    parser.add_argument("--steps", type=int, default=9,
                        help="timed steps per compressor, each beside one of the dense twin (medians)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--per-compressor-s", type=float, default=20.0)
    parser.add_argument("--budget-s", type=float, default=600.0, help="the whole run")
    parser.add_argument("--out", required=True, help="folder for step-profile.json and step-profile.md")
    parser.add_argument("--operators", type=int, default=0, metavar="N",
                        help="profile N more steps of each of --operator-compressors: operators, kernel launches "
                             "and host reads per step, into step-operators.md and .json (0: off)")
    parser.add_argument("--operator-compressors", default="none,fp16,topk,dgc,efsignsgd,qsgd,randk,powersgd",
                        help="comma-separated compressors whose steps --operators profiles")
    args = parser.parse_args(argv)
    if args.operators < 0:
        parser.error(f"--operators must be ≥ 0 (steps to profile; 0 is off), got {args.operators}")
    started = time.perf_counter()
    device = torch.device(args.device)
    launch.init_distributed(device=args.device)  # a 1-rank group: NCCL on a GPU, gloo on a CPU
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    chosen = workloads(args.tiny)
    models = args.models.split(",") if args.models else list(chosen)
    chosen_names = args.compressors.split(",") if args.compressors else compressors.available()
    # the dense baseline first; ATOMO, whose SVDs are the slowest by far, last
    names = ["none"] + sorted((n for n in chosen_names if n not in ("none", "fp32")), key=lambda n: (n == "atomo", n))
    os.makedirs(args.out, exist_ok=True)
    rows, operator_rows = [], []
    operator_names = tuple(args.operator_compressors.split(","))
    for index, model in enumerate(models):
        now = time.perf_counter()  # each model gets its share of what is left of the budget
        deadline = now + (started + args.budget_s - now) / (len(models) - index)
        rows += profile_model(model, *chosen[model], device, names, args.steps, args.warmup, args.per_compressor_s,
                              deadline, args.operators, operator_names, operator_rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    header = (f"Training step per compressor, world size 1, bf16 autocast, {device} "
              f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), median of {args.steps} "
              f"after {args.warmup}, each beside a step of a dense twin; kernels: {gpu_kernels.status()}")
    with open(os.path.join(args.out, "step-profile.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    write_table(rows, os.path.join(args.out, "step-profile.md"), header)
    if operator_rows:
        with open(os.path.join(args.out, "step-operators.json"), "w") as f:
            json.dump({"header": header, "steps": args.operators, "rows": operator_rows}, f, indent=1)
        step_operators.write_table(operator_rows, os.path.join(args.out, "step-operators.md"),
                                   f"{header}; {args.operators} profiled steps per row, counts per step")
    launch.shutdown()
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
