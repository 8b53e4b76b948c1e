"""Readers for the public datasets of the examples, from files the user downloaded.

Nothing here downloads: each reader takes a local directory in the dataset's standard
layout, checks it and says what is missing and where to get it.  torch and numpy only
(no torchvision), so the examples run wherever mergecomp runs.

* :mod:`benchmarks.harness.data.cifar`: CIFAR-10 "python version" batches, augmentation and
  normalisation as tensor operations on whole batches.
* :mod:`benchmarks.harness.data.wikitext`: WikiText word-level token files, vocabulary, batched
  streams and BPTT windows.
"""
