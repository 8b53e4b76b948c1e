"""Below the data path: how ranks find each other and move bytes.

:mod:`.backends` (collectives through torch.distributed or Horovod, every byte counted),
:mod:`.launch` (who am I in the job, joining and leaving it), :mod:`.watchdog` (timeouts and
lost peers named with the ranks behind), :mod:`.topology` (ranks per node).  Nothing here
imports compressors, memories, communicators or the runtime: they sit above it.
"""
