#!/usr/bin/env python
"""A Lightning training script whose DDP buckets mergecomp compresses.

The LightningModule and the Trainer are the user's own; the only change from plain DDP is
the strategy, :class:`mergecomp.integrations.lightning.MergecompDDPStrategy` (Lightning's
``DDPStrategy`` registers communication hooks only on CUDA; this subclass does on CPUs too):

    python examples/lightning_ddp.py --devices 2 --compressor topk --memory residual
    python examples/lightning_ddp.py --devices 2 --compressor dgc --fusion-num 4

Lightning launches the other processes itself (it runs this script again with its rank in
the environment).  The data is a learnable synthetic task (Gaussian clusters), so the script
runs anywhere; each epoch prints the training loss and the bytes mergecomp's hook handed to
its collectives per step, beside what an FP32 allreduce of the gradient takes.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402

from mergecomp.integrations.lightning import MergecompDDPStrategy  # noqa: E402


def clusters(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian clusters, one per class: learnable, and the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * 2
    labels = torch.randint(0, classes, (samples,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(samples, features, generator=g), labels)


class Classifier(L.LightningModule):
    def __init__(self, features: int = 32, classes: int = 10, lr: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_index):
        inputs, labels = batch
        loss = F.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class Traffic(L.Callback):
    """Prints, per epoch on rank 0, the training loss and the bytes per step of the hook."""

    def __init__(self, strategy: MergecompDDPStrategy):
        self.strategy = strategy
        self.last = (0, 0)

    def on_train_epoch_end(self, trainer, module):
        state = self.strategy.hook_state
        sent, steps = state.backend.bytes_sent, state.steps
        per_step = (sent - self.last[0]) / max(1, steps - self.last[1])
        self.last = (sent, steps)
        fp32 = 4 * sum(p.numel() for p in module.parameters() if p.requires_grad)
        if trainer.is_global_zero:
            loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
            print(f"epoch {trainer.current_epoch}: train loss {loss:.4f}, {per_step:,.0f} bytes/step through "
                  f"mergecomp's hook ({state.compressor!r}; FP32 allreduce: {fp32:,}), "
                  f"{steps} hook steps so far, hook epoch {state.epoch}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="processes on this machine (default 2)")
    p.add_argument("--compressor", default="topk", help="mergecomp compressor (default topk)")
    p.add_argument("--memory", default="auto", help="error feedback (default: the compressor's recommendation)")
    p.add_argument("--comm", default="auto", help="communicator (default: the compressor's recommendation)")
    p.add_argument("--fusion-num", type=int, default=None,
                   help="DDP buckets from a mergecomp fusion-num (default: DDP's bucket_cap_mb)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="per process (default 64)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = p.parse_args(argv)
    if args.devices < 1 or args.epochs < 1 or args.batch_size < 1:
        p.error("--devices, --epochs and --batch-size must be ≥ 1")

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")  # inside Lightning
    L.seed_everything(0, verbose=False)
    model = Classifier(lr=args.lr)
    own_momentum = args.compressor in ("dgc", "signum") and args.memory in ("auto", "dgc")
    if own_momentum:  # DGC's memory and SIGNUM keep the momentum themselves
        model.hparams.momentum = 0.0
    strategy = MergecompDDPStrategy(compressor=args.compressor, memory=args.memory, communicator=args.comm,
                                    schedule=args.fusion_num, process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                        callbacks=[Traffic(strategy)], enable_progress_bar=False, enable_model_summary=False,
                        logger=False, enable_checkpointing=False)
    trainer.fit(model, DataLoader(clusters(4096, 32, 10, seed=0), batch_size=args.batch_size, shuffle=True))
    # Lightning leaves the process group up; tearing it down before the interpreter does
    # keeps gloo's threads from being destroyed while they still run.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # nothing left in gloo's queue when its threads are joined
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
