"""A Lightning strategy: DDP whose buckets mergecomp compresses, on CPUs as on GPUs.

    import lightning as L
    from mergecomp.integrations.lightning import MergecompDDPStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=MergecompDDPStrategy(compressor="topk", memory="residual"))

Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a
communication hook only when the device is CUDA (its ``_register_ddp_hooks`` checks
``root_device.type == "cuda"``, from a time when DDP hooks needed NCCL); DDP has taken hooks
on gloo for years.  This subclass registers :func:`mergecomp.ddp.hook` on any device, builds
the :class:`~mergecomp.ddp.HookState` from the LightningModule being wrapped (so parameters
are named after it), and, given a ``schedule``, sets DDP's per-bucket sizes from it
(:func:`mergecomp.ddp.bucket_caps`).  Everything else is Lightning's DDP: launching,
samplers, checkpointing of the module and optimizers.  Lightning's epoch reaches the hook
before each training batch (``set_epoch``, which DGC's density warm-up follows), as a loop
of one's own would pass it.  The hook state is :attr:`hook_state` (for its counters, or
``state_dict`` into a checkpoint).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as error:  # pragma: no cover - only without lightning
    raise ImportError("mergecomp.integrations.lightning needs Lightning: pip install lightning") from error

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from .. import ddp
from ..compressors.base import Compressor
from ..memories.base import Memory


class MergecompDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with mergecomp's communication hook.

    Args:
        compressor, memory, communicator, communicator_options, nonfinite: as for
            :class:`mergecomp.ddp.HookState`.
        schedule: a fusion-num or a scheduler name for :func:`mergecomp.ddp.bucket_caps`
            (DDP's ``bucket_cap_mb_list``); None keeps DDP's ``bucket_cap_mb`` buckets.
        **kwargs: everything ``DDPStrategy`` takes (``ddp_comm_hook``/``ddp_comm_state`` are
            this class's to set and are refused).
    """

    strategy_name = "mergecomp_ddp"

    def __init__(self, compressor: Union[str, Compressor] = "none", memory: Union[str, Memory] = "auto",
                 communicator: str = "auto", *, schedule: Optional[Union[int, str]] = None,
                 communicator_options: Optional[Dict[str, Any]] = None, nonfinite: str = "skip",
                 **kwargs: Any):
        for taken in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if taken in kwargs:
                raise ValueError(f"MergecompDDPStrategy registers mergecomp's hook itself: drop {taken}=")
        super().__init__(**kwargs)
        self._hook_options = dict(compressor=compressor, memory=memory, communicator=communicator,
                                  communicator_options=communicator_options, nonfinite=nonfinite)
        self._schedule = schedule
        #: The hook's state once the model is wrapped (None before).
        self.hook_state: Optional[ddp.HookState] = None

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        if self._schedule is not None:
            self._ddp_kwargs["bucket_cap_mb_list"] = ddp.bucket_caps(model, self._schedule)
        return super()._setup_model(model)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self.hook_state is not None:  # the optimizers exist only now, after the hook
            for optimizer in self.optimizers:
                self.hook_state.check_optimizer(optimizer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        epoch = self.lightning_module.trainer.current_epoch
        if self.hook_state is not None and self.hook_state.epoch != epoch:
            self.hook_state.set_epoch(epoch)

    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        if self.hook_state is None:
            self.hook_state = ddp.HookState(self.model, **self._hook_options)
        else:  # a second fit: the state carries on, named after this model's parameters
            self.hook_state.attach(self.model)
        self.model.register_comm_hook(self.hook_state, ddp.hook)
