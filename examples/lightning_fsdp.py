#!/usr/bin/env python
"""A Lightning training script on FSDP2 whose gradient reduction mergecomp compresses.

Lightning's FSDP2 strategy is ``ModelParallelStrategy``: the LightningModule shards itself
in ``configure_model`` with ``fully_shard`` over the strategy's device mesh, and
mergecomp's one line comes right after (Lightning's ``FSDPStrategy`` wraps the model in
FSDP1's ``FullyShardedDataParallel``, which has no custom reduce-scatter to install):

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.compression = mergecomp.fsdp.register(self.net, compressor="topk", compress_ratio=0.01)

Runs on CPU ranks (gloo); Lightning starts the other processes itself:

    python examples/lightning_fsdp.py --devices 2 --compressor topk
    python examples/lightning_fsdp.py --devices 2 --compressor powersgd

Each epoch prints the training loss and the bytes this rank sent per step against what
FSDP's own reduce-scatter would have sent.
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
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import mergecomp  # noqa: E402


def clusters(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian clusters, one per class: learnable, and the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * 2
    labels = torch.randint(0, classes, (samples,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(samples, features, generator=g), labels)


class Classifier(L.LightningModule):
    def __init__(self, compressor: str = "topk", compress_ratio: float = 0.01, features: int = 32,
                 classes: int = 10, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, classes))
        self.compression = None

    def configure_model(self):
        if self.compression is not None:  # Lightning may call it again
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        options = {"compress_ratio": self.hparams.compress_ratio} if self.hparams.compressor in ("topk", "randk", "dgc") else {}
        self.compression = mergecomp.fsdp.register(self.net, compressor=self.hparams.compressor, **options)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_index):
        inputs, labels = batch
        loss = F.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def on_train_epoch_end(self):
        state, steps = self.compression, max(1, self.compression.steps)
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch}  loss {self.trainer.callback_metrics['train_loss']:.4f}  "
                  f"sent {state.wire_bytes / steps / 1e3:.1f} kB/step (FSDP's own: "
                  f"{state.uncompressed_bytes / steps / 1e3:.1f} kB/step)", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU ranks")
    parser.add_argument("--compressor", default="topk", help="a registered compressor name")
    parser.add_argument("--compress-ratio", type=float, default=0.01, help="the fraction top-k/rand-k/DGC send")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data")
    parser.add_argument("--samples", type=int, default=2048, help="training samples (the same on every rank)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    model = Classifier(args.compressor, args.compress_ratio)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = DataLoader(clusters(args.samples, 32, 10, seed=0), batch_size=64, shuffle=True)
    trainer.fit(model, data)
    # Lightning leaves the process group up; tearing it down before the interpreter does
    # keeps gloo's threads from being destroyed while they still run (an abort at exit).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # nothing left in gloo's queue when its threads are joined
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
