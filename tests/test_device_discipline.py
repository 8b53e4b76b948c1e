"""Every tensor handed to a collective lives on the group buffer's device.

NCCL takes CUDA tensors only, so a size header or receive buffer made on the CPU by a bare
``torch.tensor(...)`` breaks every CUDA job, while a CPU run cannot tell the difference:
there, every tensor is on the CPU anyway.  These tests check the rule itself on the CPU:
the communicators, memories and backends run with the default device set to ``meta``
(compressors, which are tested on their own, and torch.distributed run with the real
default), so a tensor made without ``device=`` in the collective path is a meta tensor —
and a recording backend, which notes the device of every tensor handed to it and of every
tensor it hands to torch.distributed, finds it.  Real gloo ranks carry the exchange.
"""
import functools
import types

import pytest
import torch
import torch.distributed as dist

from mergecomp import communicators, compressors, memories
from mergecomp.distributed.backends import torch_dist
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
from tests.distributed import run_ranks

CPU = torch.device("cpu")

# (communicator, compressor, its options, memory): every payload kind each communicator takes.
CONFIGS = [
    ("allreduce", "none", {}, "none"),                              # fixed-size, lossless
    ("allreduce", "fp16", {}, "residual"),                          # fixed-size, summable
    ("allreduce", "randk", {"compress_ratio": 0.1}, "residual"),    # shared indices
    ("allreduce", "powersgd", {}, "residual"),                      # multi-round
    ("allgather", "topk", {"compress_ratio": 0.1}, "residual"),     # fixed-size
    ("allgather", "signsgd", {}, "none"),
    ("allgather", "qsgd", {}, "none"),
    ("allgather", "dgc", {"compress_ratio": 0.1}, "dgc"),           # bounded variable-size
    ("allgather", "graddrop", {}, "residual"),                      # unbounded variable-size
    ("allgather", "atomo", {}, "none"),
    ("ps", "none", {}, "none"),                                     # summable: servers add
    ("ps", "fp16", {}, "residual"),
    ("ps", "randk", {"compress_ratio": 0.1}, "residual"),
    ("ps", "topk", {"compress_ratio": 0.1}, "residual"),            # servers recompress
    ("ps", "signsgd", {}, "none"),                                  # majority vote
    ("ps", "qsgd", {}, "none"),
    ("ps", "dgc", {"compress_ratio": 0.1}, "dgc"),
    ("ps", "graddrop", {}, "residual"),                             # variable-size uplink
    ("ps", "powersgd", {}, "residual"),                             # multi-round through PS
]
SHAPES = [(37, 29), (2,)]  # uneven shards; fewer elements than ranks (empty PS shards)


class RecordingDist(types.SimpleNamespace):
    """Stands in for ``torch.distributed`` inside the backend: notes the device of every
    tensor handed to a collective, then calls the real one with the real default device."""

    def __init__(self, log):
        super().__init__()
        self._log = log

    def __getattr__(self, name):
        real = getattr(dist, name)
        if not callable(real) or name[0].isupper():
            return real

        @functools.wraps(real)
        def recorded(*args, **kwargs):
            for value in list(args) + list(kwargs.values()):
                for tensor in (value if isinstance(value, (list, tuple)) else [value]):
                    if isinstance(tensor, torch.Tensor):
                        self._log.append((f"torch.distributed.{name}", tensor.device))
            with torch.device(CPU):
                return real(*args, **kwargs)
        return recorded


class RecordingBackend(TorchDistributedBackend):
    """The gloo backend, noting the device of every tensor a communicator hands it."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def _note(self, op, tensors):
        self.log.extend((op, t.device) for t in tensors)

    def allreduce_async(self, tensors):
        self._note("allreduce_async", tensors)
        return super().allreduce_async(tensors)

    def allgather_async(self, tensors, same_shapes, bound=None, limit=None):
        self._note("allgather_async", tensors)
        return super().allgather_async(tensors, same_shapes, bound, limit)

    def alltoall(self, chunks, limit=None):
        self._note("alltoall", chunks)
        return super().alltoall(chunks, limit)


def _with_real_default_device(method):
    """``method`` run with the real default device (compressors are not under test here);
    a generator's every step too (PowerSGD's rounds)."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with torch.device(CPU):
            result = method(*args, **kwargs)
        if isinstance(result, types.GeneratorType):
            return _stepped_on_cpu(result)
        return result
    return wrapped


def _stepped_on_cpu(generator):
    value = None
    while True:
        with torch.device(CPU):
            try:
                request = generator.send(value)
            except StopIteration as stop:
                return stop.value
        value = yield request


def _isolate(compressor):
    for name in ("compress", "decompress", "decompress_sum", "aggregate", "rounds",
                 "payload_bound", "transmitted_indices"):
        method = getattr(compressor, name, None)
        if method is not None:
            setattr(compressor, name, _with_real_default_device(method))
    return compressor


def _run(communicator, tensor, name):
    """One step in meta mode: what the communicator, memory and backend make by default
    is a meta tensor."""
    with torch.device("meta"):
        out = communicator.finish(communicator.start(tensor, name))
        communicator.commit()
    return out


def discipline_worker(rank, world_size, configs):
    log = []
    torch_dist.dist = RecordingDist(log)
    backend = RecordingBackend(log)
    report = {}
    for kind, name, options, memory in configs:
        compressor = _isolate(compressors.create(name, **options))
        communicator = communicators.create(kind, compressor=compressor,
                                            memory=memories.create(memory), backend=backend)
        if kind == "ps" and not compressor.average:  # the servers' vote is sent with signsgd
            _isolate(communicator.server_compressor)
        del log[:]
        for step in range(2):
            for index, shape in enumerate(SHAPES):
                g = torch.randn(shape, generator=torch.Generator().manual_seed(step * 7 + rank))
                out = _run(communicator, g, f"g{index}")
                assert out.device == CPU and out.shape == g.shape, (kind, name, out.device)
                assert torch.isfinite(out).all(), (kind, name)
        report[kind, name] = sorted({f"{op} on {device}" for op, device in log
                                     if device != CPU})
        assert log, f"{kind}/{name}: nothing reached the backend"
    return report


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "ps"])
def test_every_tensor_handed_to_the_backend_is_on_the_buffers_device(kind):
    configs = [c for c in CONFIGS if c[0] == kind]
    for report in run_ranks(discipline_worker, 3, configs, timeout=240):
        offenders = {f"{k}/{n}": found for (k, n), found in report.items() if found}
        assert not offenders, f"tensors made off the buffer's device: {offenders}"


def careless_worker(rank, world_size):
    """A backend that makes its size header with a bare torch.tensor: the check finds it."""
    log = []
    torch_dist.dist = RecordingDist(log)

    class Careless(RecordingBackend):
        def alltoall(self, chunks, limit=None):
            sizes = torch.tensor([c.numel() for c in chunks], dtype=torch.int64)  # no device=
            gathered = [torch.empty_like(sizes) for _ in range(self.size)]
            torch_dist.dist.all_gather(gathered, sizes)
            return super().alltoall(chunks, limit)

    communicator = communicators.create("ps", compressor=compressors.create("topk", compress_ratio=0.1),
                                        memory=memories.create("none"), backend=Careless(log))
    try:
        _run(communicator, torch.randn(50), "g")
    except Exception as error:  # gloo cannot send a meta tensor: the check has done its part
        log.append((f"raised {type(error).__name__}", torch.device("meta")))
    return sorted({str(device) for _, device in log})


def test_the_check_finds_a_tensor_made_without_device():
    assert all("meta" in devices for devices in run_ranks(careless_worker, 2, timeout=120))
