"""A DiLoCo inner step against the bare SGD step on the headline's LSTM, 2 gloo ranks on
loopback, one thread each: the collectives every ``opt.step()`` ran (over 24 steps, H = 8)
and the median time of an inner step (no exchange) and of a bare ``SGD.step()`` taken
between them on the same weights.  Run from
the repository root."""
import statistics
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.distributed import run_ranks  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_object", "all_to_all_single")


def measure(rank, world_size):
    import mergecomp
    from mergecomp.bench.models.lstm import LSTMLanguageModel
    torch.set_num_threads(1)
    calls = []
    for name in COLLECTIVES:
        def counted(*args, _original=getattr(dist, name), _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    torch.manual_seed(0)
    model = LSTMLanguageModel()
    x, y = torch.randint(0, 10000, (8, 35)), torch.randint(0, 10000, (8, 35))

    def backward():
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 10000), y.reshape(-1)).backward()

    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
                           sync_every=8, outer_momentum=0.5)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the bare step, on the same weights
    per_step, inner, exchange, bare = [], [], [], []
    for _ in range(24):  # interleaved, so that both see the same load
        opt.zero_grad()
        backward()
        calls.clear()
        began = time.perf_counter()
        opt.step()
        (exchange if opt.inner_steps % 8 == 0 else inner).append(time.perf_counter() - began)
        per_step.append(len(calls))
        plain.zero_grad()
        backward()
        began = time.perf_counter()
        plain.step()
        bare.append(time.perf_counter() - began)
    return per_step, statistics.median(inner) * 1e3, statistics.median(bare) * 1e3, [t * 1e3 for t in exchange]


if __name__ == "__main__":
    for rank, (per_step, inner, bare, exchange) in enumerate(run_ranks(measure, 2, timeout=600)):
        print(f"rank {rank}: collectives per opt.step() {per_step}")
        print(f"rank {rank}: inner step {inner:.1f} ms, bare SGD step {bare:.1f} ms, "
              f"step with an exchange {', '.join(f'{t:.0f}' for t in exchange)} ms")
