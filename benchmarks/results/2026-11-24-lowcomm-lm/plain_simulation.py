"""DiLoCo's Algorithm 1 in plain torch, every worker in one process, on the digits CNN: the
check that the outer-momentum problem is the recipe's, not mergecomp's.  From the
repository root:

    python benchmarks/results/2026-11-24-lowcomm-lm/plain_simulation.py "dict(H=8,outer_lr=0.7,outer_m=0.9)" ...

Each argument is the keyword arguments of run(); it prints them and the anchor's test accuracy.
"""
import os, sys, copy, torch, torch.nn as nn
sys.path.insert(0, os.getcwd())
from benchmarks.convergence import DigitsCNN, accuracy, load_digits_split, shard
torch.set_num_threads(1)
data = load_digits_split()
def run(H, outer_lr, outer_m, inner_m=0.9, lr=0.05, W=4, epochs=30, seed=0, reset_mom=False, nesterov=True, adam=False):
    xt, yt, xs, ys = data
    shards = [shard(xt, yt, r, W) for r in range(W)]
    torch.manual_seed(seed)
    base = DigitsCNN()
    models = [copy.deepcopy(base) for _ in range(W)]
    if adam:
        opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0) for m in models]
    else:
        opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=inner_m) for m in models]
    anchor = [p.detach().clone() for p in base.parameters()]
    outer = torch.optim.SGD(anchor, lr=outer_lr, momentum=outer_m, nesterov=nesterov and outer_m > 0)
    B = 32; spe = len(shards[0][0]) // B; t = 0
    lf = nn.CrossEntropyLoss()
    for ep in range(epochs):
        orders = [torch.randperm(len(shards[r][0]), generator=torch.Generator().manual_seed(seed*1_000_003+ep*1009+r)) for r in range(W)]
        for s in range(spe):
            for r in range(W):
                b = orders[r][s*B:(s+1)*B]
                opts[r].zero_grad(); lf(models[r](shards[r][0][b]), shards[r][1][b]).backward(); opts[r].step()
            t += 1
            if t % H == 0:
                for i, a in enumerate(anchor):
                    a.grad = sum(a.detach() - list(m.parameters())[i].detach() for m in models) / W
                outer.step()
                with torch.no_grad():
                    for m in models:
                        for p, a in zip(m.parameters(), anchor): p.copy_(a)
                if reset_mom:
                    for o in opts: o.state.clear()
    m = copy.deepcopy(base)
    with torch.no_grad():
        for p, a in zip(m.parameters(), anchor): p.copy_(a)
    return accuracy(m, xs, ys)
if __name__ == '__main__':
    import itertools
    for args in [eval(a) for a in sys.argv[1:]]:
        print(args, round(100*run(**args),1), flush=True)
