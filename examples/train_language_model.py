#!/usr/bin/env python
"""Train a word-level LSTM language model on WikiText with compressed gradient exchange.

    python examples/train_language_model.py --data-dir data/wikitext-2 --nproc 2
    torchrun --nproc_per_node 2 examples/train_language_model.py --data-dir data/wikitext-2

``--data-dir`` holds ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``
(or a ``wikitext-2/`` or ``wikitext-103/`` folder with them; docs/examples.md says where to
get them: nothing here downloads).  Every line is its words plus ``<eos>``; the vocabulary
is the training file's; unknown words read as ``<unk>``.  Each split is one token stream cut
into rows, ``--batch-size`` rows per worker, read in ``--bptt``-token windows with the LSTM
state carried from one window to the next (truncated backpropagation through time).

The training of PyTorch's word_language_model example with the "medium" LSTM of Zaremba et
al. (2 layers of 650 units, dropout 0.5): plain SGD at learning rate 20, gradient norm
clipped to 0.25, 35-token windows, 20 rows per worker, the learning rate divided by 4 after
every epoch whose validation loss is no better than the best so far, 40 epochs.  The
learning rate is not scaled with the number of workers (the averaged gradient of N workers
is that of an N-times larger batch).

Clipping acts on the averaged gradient, as under DDP: when ``backward()`` returns, ``p.grad``
holds the average over all workers, so ``clip_grad_norm_`` between backward and ``step()``
clips what every worker applies.  With the ``dgc`` memory
the clipping is DGC's local one instead (Lin et al., ICLR 2018, section 3.2): each rank's own
gradient is clipped to ``--clip`` / sqrt(workers) before momentum correction, per fused group.

Each epoch prints the training loss, the validation and test perplexities and the bytes
each worker sent per step.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import exchange  # noqa: E402  (the examples' shared flags; it puts the repository on the path)
from benchmarks import harness  # noqa: E402
from mergecomp import launch
from benchmarks.harness.data import wikitext  # noqa: E402
from benchmarks.harness.models import count_parameters  # noqa: E402
from benchmarks.harness.models.lstm import LSTMLanguageModel  # noqa: E402


def train(args) -> dict:
    info, device = exchange.start_worker(args)
    log = print if info.rank == 0 else (lambda *a, **k: None)
    corpus = wikitext.load_wikitext(args.data_dir)
    rows = {
        "train": wikitext.shard_rows(corpus.train, args.batch_size, info.rank, info.world_size),
        "valid": wikitext.shard_rows(corpus.valid, args.eval_batch_size, info.rank, info.world_size),
        "test": wikitext.shard_rows(corpus.test, args.eval_batch_size, info.rank, info.world_size),
    }
    rows = {split: r.to(device) for split, r in rows.items()}
    vocab_size = len(corpus.vocabulary)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = LSTMLanguageModel(vocab_size, args.hidden_size, args.layers, args.dropout,
                              tie_weights=args.tie_weights).to(device)
    local_clipping = (args.memory or exchange.build_compressor(args).recommended_memory) == "dgc"
    optimizer = exchange.build_optimizer(
        model, args, lr=args.lr,
        memory_clip_norm=args.clip / math.sqrt(info.world_size) if local_clipping and args.clip else None)
    steps_per_epoch = wikitext.num_windows(rows["train"], args.bptt)
    num_params = count_parameters(model)
    log(f"WikiText from {corpus.folder}: vocabulary {vocab_size:,}, tokens train "
        f"{corpus.train.numel():,}, valid {corpus.valid.numel():,}, test {corpus.test.numel():,}")
    log(f"Model: LSTM {args.layers}x{args.hidden_size} ({num_params / 1e6:.2f}M parameters); "
        f"{info.world_size} worker(s) ({info.launcher}) on {device.type}, {args.batch_size} rows "
        f"per worker, {args.bptt}-token windows, {steps_per_epoch} steps per epoch")
    clipping = (f"local clipping to {args.clip:g}/sqrt({info.world_size}) in the dgc memory"
                if local_clipping else f"averaged gradient clipped to norm {args.clip:g}"
                if args.clip else "no clipping")
    log(f"Exchange: {optimizer.communicator!r}, {args.fusion_num} fusion group(s); SGD lr "
        f"{args.lr:g}, {clipping}", flush=True)

    traffic = exchange.Traffic(optimizer.backend)
    lr, best_valid = args.lr, math.inf
    result = {}
    for epoch in range(args.epochs):
        started = time.perf_counter()
        optimizer.set_epoch(epoch)  # DGC's density warm-up follows the epoch
        model.train()
        state = None
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = 0
        for inputs, targets in wikitext.bptt_windows(rows["train"], args.bptt):
            optimizer.zero_grad()
            logits, state = model(inputs, state, return_state=True)
            state = tuple(s.detach() for s in state)  # carry the state, not its history
            loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1))
            loss.backward()  # groups are compressed and sent while backward runs
            if args.clip and not local_clipping:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # the averaged gradient
            optimizer.step()
            loss_sum += loss.detach() * targets.numel()
            tokens += targets.numel()
        handed, wire = traffic.read()
        valid = evaluate(model, rows["valid"], args.bptt, vocab_size)
        test = evaluate(model, rows["test"], args.bptt, vocab_size)
        totals = exchange.all_sum([float(loss_sum), tokens, *valid, *test,
                                   handed / steps_per_epoch, wire / steps_per_epoch], device)
        train_loss, valid_loss, test_loss = (totals[0] / totals[1], totals[2] / totals[3],
                                             totals[4] / totals[5])
        result = {"epoch": epoch, "train_loss": train_loss, "lr": lr,
                  "valid_perplexity": math.exp(valid_loss), "test_perplexity": math.exp(test_loss),
                  "bytes_per_step": totals[6] / info.world_size,
                  "wire_bytes_per_step": totals[7] / info.world_size}
        log(f"epoch {epoch}: train loss {train_loss:.4f} (perplexity {_perplexity(train_loss)}), "
            f"valid perplexity {_perplexity(valid_loss)}, test perplexity "
            f"{_perplexity(test_loss)}, lr {lr:g}{exchange.density_text(optimizer)}, "
            f"{exchange.traffic_line(result['bytes_per_step'], result['wire_bytes_per_step'], num_params, info.world_size)}, "
            f"{time.perf_counter() - started:.1f} s", flush=True)
        if valid_loss < best_valid:
            best_valid = valid_loss
        else:  # no better than the best: anneal, as PyTorch's example does
            lr /= 4.0
            for group in optimizer.param_groups:
                group["lr"] = lr
    launch.shutdown()
    return result


@torch.no_grad()
def evaluate(model, rows, bptt: int, vocab_size: int):
    """(summed cross entropy, tokens) of ``rows``, the state carried across windows."""
    model.eval()
    state = None
    total = torch.zeros((), dtype=torch.float64, device=rows.device)
    count = 0
    for inputs, targets in wikitext.bptt_windows(rows, bptt):
        logits, state = model(inputs, state, return_state=True)
        total += F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1),
                                 reduction="sum")
        count += targets.numel()
    return float(total), count


def _perplexity(loss: float) -> str:
    return f"{math.exp(loss):.2f}" if loss < 700 else "inf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True,
                   help="folder with wiki.{train,valid,test}.tokens (or wikitext-2/ holding them)")
    p.add_argument("--hidden-size", type=int, default=650, help="LSTM and embedding width (default 650)")
    p.add_argument("--layers", type=int, default=2, help="LSTM layers (default 2)")
    p.add_argument("--dropout", type=float, default=0.5, help="dropout probability (default 0.5)")
    p.add_argument("--tie-weights", action="store_true", help="share embedding and decoder weights")
    p.add_argument("--epochs", type=int, default=40, help="passes over the training text (default 40)")
    p.add_argument("--batch-size", type=int, default=20, help="rows per worker (default 20)")
    p.add_argument("--eval-batch-size", type=int, default=10, help="rows per worker when evaluating")
    p.add_argument("--bptt", type=int, default=35, help="tokens per window (default 35)")
    p.add_argument("--lr", type=float, default=20.0,
                   help="SGD learning rate, divided by 4 after an epoch that does not improve (default 20)")
    p.add_argument("--clip", type=float, default=0.25, help="gradient norm limit; 0 turns clipping off")
    p.add_argument("--seed", type=int, default=42, help="seeds the initial model, the same on every rank (default 42)")
    exchange.add_exchange_arguments(p, compressor="topk", compress_ratio=0.01, momentum=0.0)
    args = p.parse_args(argv)
    for name in ("hidden_size", "layers", "epochs", "batch_size", "eval_batch_size", "bptt"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.clip < 0:
        p.error(f"--clip must be ≥ 0 (0: no clipping), got {args.clip}")
    try:
        wikitext.find_folder(args.data_dir)
    except FileNotFoundError as error:
        p.error(str(error))
    exchange.check_exchange_arguments(p, args)
    return args


def main(argv=None) -> int:
    exchange.run(train, parse_args(argv))
    return 0


if __name__ == "__main__":
    harness.exit_with(main)
