#!/usr/bin/env python
"""Deep Gradient Compression written out in plain torch, on a language-model task of
``convergence.py``: is a gap to dense DGC's or mergecomp's?

Lin et al., "Deep Gradient Compression", ICLR 2018, Algorithm 1 with the paper's four
techniques, on one flat vector of every gradient per rank, without any mergecomp compressor,
memory or communicator:

    g ← the rank's gradient, clipped to clip/√N (local gradient clipping, section 3.2)
    u ← m·u + g;  v ← v + u                      (momentum correction)
    send the k = density·n largest |v| (exact top-k) as values and int64 indices
    allgather, sum, divide by N; the optimizer (SGD, no momentum) steps on that average
    v[sent] ← 0;  u[sent] ← 0                     (momentum factor masking; --no-masking keeps u)
    density: 25% → the target over the first --warmup-steps steps, exponentially (warm-up)

``--variant topk`` is plain top-k with error feedback instead, as mergecomp's ``topk``
recipe trains it (the residual memory, local clipping, heavy-ball momentum in the
optimizer *after* the exchange):

    g ← the rank's gradient, clipped to clip/√N;  v ← r + g
    send the k largest |v|;  r ← v with the sent coordinates zeroed
    the optimizer (SGD with momentum m) steps on the average

``--variant ef21`` is EF21-SGDM (Fatkhullin, Tyurin and Richtárik, "Momentum Provably
Improves Error Feedback!", NeurIPS 2023): instead of a residual of what was not sent, each
rank keeps an estimate w of its own velocity and sends the top-k of what the estimate
misses; every rank keeps the same average W of the estimates, and SGD (no momentum) steps
on W, every coordinate every step:

    g ← the rank's gradient, clipped to clip/√N;  u ← m·u + g
    c ← the k largest |u − w| (values and indices);  w ← w + c
    allgather;  W ← W + (sum of every rank's c) / N;  the optimizer steps on W

``--variant efsignsgd`` is EF-SignSGD (Karimireddy et al., ICML 2019, Algorithm 2, the
scaled sign with error feedback) as mergecomp's ``efsignsgd`` recipe trains it, one scale
per parameter tensor:

    p ← g + e (per tensor);  send mean|p| · sign(p) (+1 for a zero);  e ← p − what was sent
    average; clip the average to --clip; SGD without momentum at lr / (1 − m)

``--variant signsgd`` is signSGD with majority vote (Bernstein et al., 2018/2019): each rank
sends sign(g) (+1 for a zero, as the IEEE sign bit), the update is the sign of the sum of
the ranks' signs (0 on a tie), and SGD with momentum m steps on it at ``--lr``, no clipping.

``--variant powersgd`` trains through ``torch.nn.parallel.DistributedDataParallel`` with
PyTorch's own ``powerSGD_hook`` (one rank-``--rank`` factorisation per layer, error
feedback, warm start, compressing from its minimum start iteration 2, or ``--start-iter``:
PyTorch's default is 1,000 plain allreduces first), momentum SGD after
the exchange and the averaged gradient clipped, as mergecomp's ``powersgd`` row.  With
``--momentum-before`` the momentum moves before the exchange instead, as top-k's default
memory does: each rank clips its gradient to clip/√N, accumulates u ← m·u + g, and the
hook compresses u (its error feedback on top); SGD without momentum steps on the average.

``--dense-vectors`` sends the one-dimensional tensors (biases, normalisation gains: under
1% of either model's elements) uncompressed, averaged by an allreduce, and compresses the
matrices only, as DGC's released code leaves biases and batch-norm parameters dense.

The task, data, model, seeds, batch order and validation are ``convergence.py``'s (from
``benchmarks.harness``: the harness, not the compressor), so a row here and the ``dgc`` row of
``convergence.py --task char-lstm`` at the same settings train the same model on the same
windows.  A dense row (``--density 1``, momentum SGD, the averaged gradient clipped) is the
reference's own baseline.

    python -m benchmarks.reference_dgc_lm --task char-lstm --workers 2 --steps 400 --lr 2 \\
        --density 0.001 --warmup-steps 100
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist

if not __package__:  # the convergence benchmark is a sibling module: import it through the package
    sys.exit("benchmarks/reference_dgc_lm.py imports the convergence benchmark's task: run it as a module from "
             "the repository root: .venv/bin/python -m benchmarks.reference_dgc_lm ...")
from benchmarks import convergence  # noqa: E402  the task's defaults
from mergecomp import launch  # noqa: E402
from benchmarks.harness import lm  # noqa: E402
from benchmarks.harness.data import text  # noqa: E402
from benchmarks.harness import save_with_provenance  # noqa: E402


def density_at(step: int, target: float, warmup_steps: int) -> float:
    """The paper's exponential warm-up from 25% to ``target``, measured in steps."""
    if step >= warmup_steps or target >= 0.25:
        return target
    return max(target, 0.25 * (target / 0.25) ** (step / warmup_steps))


def signs(tensor):
    """±1 per element, +1 for a zero (the IEEE sign bit, as the wire formats pack it)."""
    return torch.where(torch.signbit(tensor), -1.0, 1.0).to(tensor.dtype)


def sign_vote(params) -> int:
    """signSGD's majority vote on the flat gradient of ``params``, written into each ``p.grad``;
    returns the signs sent by this rank."""
    g = torch.cat([p.grad.reshape(-1) for p in params])
    votes = signs(g)
    dist.all_reduce(votes)
    update, offset = torch.sign(votes), 0
    for p in params:
        p.grad.copy_(update[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return g.numel()


def scaled_sign(params, state, world) -> int:
    """EF-SignSGD on each ``p.grad`` of ``params``: the residual added, each tensor's mean
    magnitude times its sign sent and averaged into ``p.grad``, what it missed kept as the
    residual; returns the signs sent by this rank."""
    sent = 0
    for index, p in enumerate(params):
        compensated = p.grad + state.get(index, torch.zeros_like(p.grad))
        update = compensated.abs().mean() * signs(compensated)
        state[index] = compensated - update
        dist.all_reduce(update)
        p.grad.copy_(update.div_(world))
        sent += p.numel()
    return sent


def average_dense(params, world) -> int:
    """Average each ``p.grad`` of ``params`` uncompressed; returns the values sent."""
    for p in params:
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    return sum(p.numel() for p in params)


def allgather_average(values, indices, size: int, world: int, out=None):
    """The average over ranks of every rank's sparse (values, indices) of a ``size``-long
    vector, added into ``out`` (zeros when None)."""
    gathered_values = [torch.empty_like(values) for _ in range(world)]
    gathered_indices = [torch.empty_like(indices) for _ in range(world)]
    dist.all_gather(gathered_values, values)
    dist.all_gather(gathered_indices, indices)
    average = torch.zeros(size, dtype=values.dtype)
    for i, x in zip(gathered_indices, gathered_values):
        average.index_add_(0, i, x)
    average.div_(world)
    return average if out is None else out.add_(average)


def write_grads(params, flat) -> None:
    """``flat`` (every gradient end to end) into each ``p.grad``."""
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def ef21_exchange(g, state, options, world) -> int:
    """EF21-SGDM on the flat gradient ``g`` (clipped already): the top-k of the velocity's
    change since this rank's estimate; ``state["average"]`` becomes the average estimate,
    what the optimizer steps on.  Returns the values sent."""
    u = state.setdefault("u", torch.zeros_like(g))
    estimate = state.setdefault("estimate", torch.zeros_like(g))
    u.mul_(options["momentum"]).add_(g)
    missing = u - estimate
    k = max(1, int(round(options["density"] * g.numel())))
    indices = torch.topk(missing.abs(), k, sorted=False).indices
    values = missing[indices]
    estimate[indices] += values
    state["average"] = allgather_average(values, indices, g.numel(), world,
                                         out=state.get("average"))  # the first step's sum starts it
    return k


def exchange(params, state, options, step, world) -> int:
    """DGC on the flat gradient of ``params``: writes the averaged sparse update into each
    ``p.grad``; returns the values sent by this rank."""
    grads = [p.grad for p in params]
    g = torch.cat([x.reshape(-1) for x in grads])
    if options["clip"]:
        g.mul_(min(1.0, options["clip"] / math.sqrt(world) / (float(g.norm()) + 1e-12)))
    if options["variant"] == "ef21":
        sent = ef21_exchange(g, state, options, world)
        write_grads(params, state["average"])
        return sent
    u, v = state.setdefault("u", torch.zeros_like(g)), state.setdefault("v", torch.zeros_like(g))
    if options["variant"] == "topk":  # the residual takes the gradient; momentum is the optimizer's
        v.add_(g)
    else:
        u.mul_(options["momentum"]).add_(g)
        v.add_(u)
    k = max(1, int(round(density_at(step, options["density"], options["warmup_steps"]) * g.numel())))
    indices = torch.topk(v.abs(), k, sorted=False).indices
    average = allgather_average(v[indices], indices, g.numel(), world)
    v[indices] = 0
    if options["masking"]:
        u[indices] = 0
    write_grads(params, average)
    return k


def ddp_powersgd(model, rank: int, seed: int, start_iter: int = 2, momentum_before: float = 0.0,
                 local_clip: float = 0.0):
    """``model`` in DDP with PyTorch's per-layer PowerSGD hook, compressing from step
    ``start_iter`` (plain allreduces before it: the hook's own warm-up, 2 at the least).
    With ``momentum_before`` m > 0 the hook is handed each rank's velocity u ← m·u + g of its
    gradient clipped to ``local_clip`` (0: unclipped) instead of the gradient."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    # One bucket: with several, the hook's chained allreduces timed out on gloo ("Application
    # timeout caused pair closure"); its first two steps are plain allreduces either way.
    net = DistributedDataParallel(model, bucket_cap_mb=1024)
    hook = powerSGD_hook.powerSGD_hook
    if momentum_before:
        velocities = {}

        def hook(state, bucket, compress=powerSGD_hook.powerSGD_hook):
            buffer = bucket.buffer()  # this rank's gradient; the hook averages
            if local_clip:
                buffer.mul_(min(1.0, local_clip / (float(buffer.norm()) + 1e-6)))
            offset = 0  # per parameter: DDP may order its bucket anew after the first step
            for param in bucket.parameters():
                piece = buffer[offset:offset + param.numel()]
                velocity = velocities.setdefault(param, torch.zeros_like(piece))
                piece.copy_(velocity.mul_(momentum_before).add_(piece))
                offset += param.numel()
            assert offset == buffer.numel(), "the bucket holds its parameters' gradients end to end"
            return compress(state, bucket)
    net.register_comm_hook(powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=max(2, start_iter),
        use_error_feedback=True, warm_start=True, random_seed=seed), hook)
    return net


def train(options: dict) -> list:
    info = launch.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    rank, world = info.rank, info.world_size
    task = lm.get_task(options["task"])
    corpus = text.load_text(options["corpus"], "char")
    valid = text.validation_rows(corpus.valid, 16, 512)
    runs = []
    for seed in options["seeds"]:
        torch.manual_seed(seed)
        model = task.build(corpus.vocab_size)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # every rank starts from rank 0's model, as the wrapper broadcasts it
            dist.broadcast(p.data, 0)
        powersgd = options["variant"] == "powersgd"
        dense = options["density"] >= 1.0 or powersgd
        before = powersgd and options["momentum_before"]
        net = ddp_powersgd(model, options["rank"], seed, options["start_iter"],
                           options["momentum"] if before else 0.0,
                           options["clip"] / math.sqrt(world) if before else 0.0) if powersgd else model
        after = (dense and not before) or options["variant"] in ("topk", "signsgd")  # momentum after the exchange
        folded = options["variant"] == "efsignsgd"  # SGD without momentum at lr / (1 − m)
        lr = options["lr"] / (1.0 - options["momentum"]) if folded else options["lr"]
        optimizer = torch.optim.SGD(params, lr=lr, momentum=options["momentum"] if after else 0.0)
        stream = lm.TextStream(corpus, options["batch_size"], task.bptt, rank, world)
        curve = [dict(step=0, valid_loss=lm.validation_loss(task, model, valid))]
        state, dgc_state, sent, done = None, {}, 0, 0
        for inputs, targets, _epoch, first in stream:
            if done == options["steps"]:
                break
            if first:
                state = None
            optimizer.zero_grad()
            loss, state = lm.training_loss(task, net, inputs, targets, state)
            loss.backward()
            if dense:
                for p in params:
                    if not powersgd:  # DDP's hook left the average in p.grad
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
                if options["clip"] and not before:  # before: each rank clipped its own gradient
                    torch.nn.utils.clip_grad_norm_(params, options["clip"])
            elif options["variant"] == "signsgd":
                sent += sign_vote(params)
            elif options["variant"] == "efsignsgd":
                sent += scaled_sign(params, dgc_state, world)
                if options["clip"]:
                    torch.nn.utils.clip_grad_norm_(params, options["clip"])
            elif options["dense_vectors"]:
                sent += average_dense([p for p in params if p.dim() <= 1], world)
                sent += exchange([p for p in params if p.dim() > 1], dgc_state, options, done, world)
            else:
                sent += exchange(params, dgc_state, options, done, world)
            optimizer.step()
            done += 1
            if done % options["eval_every"] == 0 or done == options["steps"]:
                curve.append(dict(step=done, valid_loss=lm.validation_loss(task, model, valid)))
        runs.append(dict(seed=seed, valid_loss=curve[-1]["valid_loss"], curve=curve,
                         values_sent_per_step=sent / max(1, done)))
    launch.shutdown()
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(lm.TASKS), default="char-lstm")
    p.add_argument("--corpus", default="pydoc")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=convergence.DEFAULT_LM_STEPS)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--lr", type=float, required=True, help="dense SGD's learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument("--density", type=float, default=0.001, help="fraction sent; 1: dense SGD")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--no-masking", action="store_true", help="keep the momentum of sent coordinates")
    p.add_argument("--variant", choices=("dgc", "topk", "signsgd", "powersgd", "ef21", "efsignsgd"), default="dgc",
                   help="dgc: momentum correction (the default); topk: a residual, momentum in the optimizer; "
                        "signsgd: majority vote; powersgd: DDP with PyTorch's PowerSGD hook; "
                        "ef21: EF21-SGDM, the top-k of the velocity's change; efsignsgd: the scaled "
                        "sign with error feedback, momentum folded into lr")
    p.add_argument("--dense-vectors", action="store_true",
                   help="send 1-D tensors (biases, norms) uncompressed; compress the matrices only")
    p.add_argument("--start-iter", type=int, default=2,
                   help="--variant powersgd: the step it starts compressing at (PyTorch's start_powerSGD_iter; "
                        "plain allreduces before it)")
    p.add_argument("--rank", type=int, default=2, help="PowerSGD's approximation rank (--variant powersgd)")
    p.add_argument("--momentum-before", action="store_true",
                   help="--variant powersgd: SGD's momentum before the exchange, each rank's gradient "
                        "clipped to clip/√N (SGD without momentum steps on the average)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default=None, help="a JSON file for the runs")
    args = p.parse_args(argv)
    if not 0 < args.density <= 1 or args.workers < 1 or args.steps < 1 or args.eval_every < 1 \
            or args.warmup_steps < 0 or args.clip < 0 or not args.lr > 0:
        p.error("--density must be in (0, 1], --workers, --steps, --eval-every ≥ 1, "
                "--warmup-steps, --clip ≥ 0 and --lr > 0")
    options = dict(task=args.task, corpus=args.corpus, steps=args.steps, eval_every=args.eval_every,
                   lr=args.lr, momentum=args.momentum, batch_size=args.batch_size, clip=args.clip,
                   density=args.density, warmup_steps=args.warmup_steps, masking=not args.no_masking,
                   variant=args.variant, rank=args.rank, dense_vectors=args.dense_vectors,
                   start_iter=args.start_iter, momentum_before=args.momentum_before,
                   seeds=[int(s) for s in args.seeds.split(",")])
    runs = launch.spawn(train, args.workers, args=(options,))[0]
    if args.variant == "powersgd":
        kind = f"PyTorch's PowerSGD hook, rank {args.rank}, compressing from step {max(2, args.start_iter)}"
        kind += ", momentum before the exchange" if args.momentum_before else ""
    elif args.density >= 1:
        kind = "dense"
    elif args.variant == "signsgd":
        kind = f"signSGD with majority vote, momentum {args.momentum:g} after the vote"
    elif args.variant == "efsignsgd":
        kind = f"EF-SignSGD, lr {args.lr:g} / (1 − {args.momentum:g}), no momentum"
    elif args.variant == "ef21":
        kind = f"EF21-SGDM top-k {args.density:g}, momentum {args.momentum:g} before the exchange"
    elif args.variant == "topk":
        kind = f"top-k {args.density:g} with a residual, momentum {args.momentum:g} after the exchange"
    else:
        kind = (f"DGC {args.density:g}, warm-up {args.warmup_steps} steps, "
                f"masking {'on' if options['masking'] else 'off'}")
    if args.dense_vectors:
        kind += ", 1-D tensors uncompressed"
    for run in runs:
        print(f"{kind}, seed {run['seed']}: validation loss {run['valid_loss']:.4f}, curve "
              f"{[round(c['valid_loss'], 3) for c in run['curve']]}, "
              f"{run['values_sent_per_step']:.0f} values sent per step")
    if args.out:
        save_with_provenance(args.out, {"options": options, "workers": args.workers, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
