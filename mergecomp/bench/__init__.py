"""The benchmark harness's pieces that are not needed to train: the emulated cluster and
its link profiles.

``mergecomp.bench.cluster`` runs N workers behind shaped links on one Linux host and
``mergecomp.bench.profiles`` names those links; ``benchmarks/cluster.py`` is their command
line, and the sweep, the headline campaign and the simulator's check start clusters
through them.
"""
