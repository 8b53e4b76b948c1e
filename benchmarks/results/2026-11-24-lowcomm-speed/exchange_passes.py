"""The passes of one DiLoCo exchange on the headline's LSTM (19.78M parameters), one process,
one thread: forming the pseudo-gradient and the outer Nesterov step, each the way it was
(a concatenation and a subtraction; torch.optim.SGD) and the way DiLoCo does it now (written
in place), and the merge.  Run from the repository root; median of 5 of each, in ms."""
import statistics
import time

import torch

from mergecomp.bench.models.lstm import LSTMLanguageModel

torch.set_num_threads(1)
params = list(LSTMLanguageModel().parameters())
anchor = torch.cat([p.detach().reshape(-1) for p in params]).clone()
delta = torch.empty_like(anchor)


def ms(fn, repeat=5):
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return round(statistics.median(times) * 1e3, 1)


def delta_by_concatenation():
    return anchor - torch.cat([p.detach().reshape(-1) for p in params])


def delta_in_place():
    offset = 0
    for p in params:
        n = p.numel()
        torch.sub(anchor[offset:offset + n].view(p.shape), p.detach(), out=delta[offset:offset + n].view(p.shape))
        offset += n


average = delta_by_concatenation()
sgd = torch.optim.SGD([anchor], lr=0.7, momentum=0.5, nesterov=True)
momentum = torch.zeros_like(anchor)


def outer_by_torch_sgd():
    anchor.grad = average
    sgd.step()
    anchor.grad = None


def outer_in_place():
    momentum.mul_(0.5).add_(average)
    anchor.add_(torch.add(average, momentum, alpha=0.5, out=delta), alpha=-0.7)


def merge():
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(anchor[offset:offset + n].view(p.shape))
            offset += n


print(f"{sum(p.numel() for p in params):,} parameters")
print("pseudo-gradient: concatenation and subtraction", ms(delta_by_concatenation), "ms; in place", ms(delta_in_place), "ms")
print("outer Nesterov step: torch.optim.SGD", ms(outer_by_torch_sgd), "ms; in place", ms(outer_in_place), "ms")
print("merge (local weights <- anchor)", ms(merge), "ms")
