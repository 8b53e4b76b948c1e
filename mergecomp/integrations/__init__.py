"""Adapters for training frameworks that own the training loop (Lightning).

Accelerate needs none: register :mod:`mergecomp.ddp`'s hook on the model that
``accelerator.prepare`` returns (see ``examples/accelerate_ddp.py``).
"""
