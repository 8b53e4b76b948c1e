"""DistributedOptimizer on real gloo ranks: equivalence, error feedback, edge cases, state."""
import io

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.compressors.base import payload_nbytes
from tests.distributed import run_ranks

BATCH = 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def make_optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def reference_params(kind, world_size, steps, model_factory=None, batches=None):
    """One process, the concatenated batches of all ranks: what data parallelism must equal
    (of ``make_model`` and ``batch`` unless given others)."""
    model = (model_factory or make_model)()
    opt = make_optimizer(kind, model)
    for step in range(steps):
        xs, ys = zip(*((batches or batch)(step, r) for r in range(world_size)))
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train(rank, kind, steps, **wrapper_kwargs):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(make_optimizer(kind, model), model.named_parameters(),
                                         **wrapper_kwargs)
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def equivalence_worker(rank, world_size):
    results = {}
    for kind in ("sgd", "adam"):
        for fusion in (0, 1, 2):
            params, opt = train(rank, kind, 4, schedule=fusion)
            results[(kind, fusion)] = (params, len(opt.plan))
    return results


def test_uncompressed_training_equals_single_process_on_concatenated_batches():
    world_size = 2
    results = run_ranks(equivalence_worker, world_size)
    for kind in ("sgd", "adam"):
        expected = reference_params(kind, world_size, 4)
        group_counts = set()
        for fusion in (0, 1, 2):
            for rank_result in results:
                params, groups = rank_result[(kind, fusion)]
                group_counts.add((fusion, groups))
                for got, want in zip(params, expected):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert {g for f, g in group_counts if f == 0} == {6}  # layer-wise: one per tensor
        assert {g for f, g in group_counts if f == 1} == {1}
        assert {g for f, g in group_counts if f == 2} == {2}


def error_feedback_worker(rank, world_size):
    """Σ transmitted + residual == Σ gradients, for topk + residual (checked on the buffer)."""
    compressor = mergecomp.compressors.create("topk", compress_ratio=0.1)
    memory = mergecomp.memories.create("residual")
    torch.manual_seed(rank)
    total_grad = torch.zeros(50)
    total_sent = torch.zeros(50)
    for _ in range(6):
        grad = torch.randn(50)
        total_grad += grad
        compensated = memory.compensate(grad, "g")
        payload, ctx = compressor.compress(compensated, "g")
        memory.update(compensated, "g", compressor, payload, ctx)
        total_sent += compressor.decompress(payload, ctx)
        assert payload_nbytes(payload) == 5 * (1 + 1) + 1 + 4  # an 8-bit value and 8-bit offset each, a 1-byte count, the scale
    torch.testing.assert_close(total_sent + memory.residuals["g"], total_grad, rtol=1e-5, atol=1e-5)
    # And through the optimizer over the network: training proceeds and residuals exist.
    params, opt = train(rank, "sgd", 3, compressor=compressor, memory=memory, communicator="allgather",
                        schedule=2)
    return [p.sum().item() for p in params], sorted(memory.residuals)


def test_topk_residual_error_feedback_invariant():
    a, b = run_ranks(error_feedback_worker, 2)
    assert a == b  # every rank applied the same averaged update
    assert "group0" in a[1] and "group1" in a[1]


def randk_worker(rank, world_size):
    compressor = mergecomp.compressors.create("randk", compress_ratio=0.2, seed=3)
    _, ctx = compressor.compress(torch.randn(100), "layer")
    reduced = []
    for comm in ("allreduce", "allgather"):
        c = mergecomp.compressors.create("randk", compress_ratio=0.2, seed=3)
        communicator = mergecomp.communicators.create(
            comm, compressor=c, memory=mergecomp.memories.create("none"),
            backend=mergecomp.distributed.backends.default_backend())
        torch.manual_seed(rank)
        reduced.append(communicator.finish(communicator.start(torch.randn(100), "layer")))
    return ctx.indices.tolist(), reduced


def test_randk_indices_shared_and_allreduce_equals_allgather():
    results = run_ranks(randk_worker, 3)
    assert results[0][0] == results[1][0] == results[2][0]
    for indices, (via_allreduce, via_allgather) in results:
        torch.testing.assert_close(via_allreduce, via_allgather)
        assert int((via_allreduce != 0).sum()) <= 20
    torch.testing.assert_close(results[0][1][0], results[2][1][0])


def allgather_sizes_worker(rank, world_size):
    backend = mergecomp.distributed.backends.default_backend()
    # Rank r sends r values (rank 0 sends nothing) and a scalar of another dtype.
    mine = (torch.arange(rank, dtype=torch.float32), torch.tensor(rank, dtype=torch.int64))
    gathered = backend.allgather_async(mine, same_shapes=False).wait()
    empty = backend.allgather_async((torch.empty(0),), same_shapes=False).wait()
    # With a bound the shapes travel inside one fixed-size blob: one collective, not two.
    before = backend.collectives
    bounded = backend.allgather_async(mine, same_shapes=False, bound=(torch.Size([2]), torch.Size([]))).wait()
    one_collective = backend.collectives - before == 1
    return ([[t.tolist() for t in parts] for parts in gathered], [p[0].numel() for p in empty],
            [[t.tolist() for t in parts] for parts in bounded], one_collective)


def test_allgather_variable_and_empty_payloads_complete():
    results = run_ranks(allgather_sizes_worker, 3)
    for gathered, empty, bounded, one_collective in results:
        assert gathered == bounded == [[[], 0], [[0.0], 1], [[0.0, 1.0], 2]]
        assert empty == [0, 0, 0] and one_collective


def test_a_payload_over_its_bound_is_refused():
    from mergecomp.distributed.backends.serialize import pack_bounded, unpack_bounded
    parts = (torch.arange(3, dtype=torch.float16), torch.arange(3, dtype=torch.int32))
    blob = pack_bounded(parts, (torch.Size([5]), torch.Size([5])), "cpu")
    assert [t.tolist() for t in unpack_bounded(blob, [torch.float16, torch.int32])] == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(ValueError, match=r"shape \(3,\) exceeds its bound \(2,\).*payload_bound"):
        pack_bounded(parts, (torch.Size([2]), torch.Size([5])), "cpu")
    with pytest.raises(ValueError, match="one shape per part"):
        pack_bounded(parts, (torch.Size([5]),), "cpu")


class Branchy(nn.Module):
    """A model whose second head is used only when asked: an unused parameter on one rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.extra = nn.Linear(8, 3)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x, use_extra):
        h = torch.tanh(self.frozen(torch.tanh(self.body(x))))
        out = self.head(h)
        return out + self.extra(h) if use_extra else out


def edge_case_worker(rank, world_size):
    results = {}
    # Unused parameter on rank 1 only, frozen parameter everywhere; several steps so the
    # hooks path (not just the recording iteration) runs.
    model = Branchy()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = mergecomp.DistributedOptimizer(base, model.named_parameters(), schedule=0)
    frozen_before = model.frozen.weight.clone()
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x, use_extra=(rank == 0)), y).backward()
        opt.step()
    results["unused"] = [p.detach().clone() for p in model.parameters()]
    results["frozen_same"] = torch.equal(frozen_before, model.frozen.weight)
    results["plan_names"] = [n for g in opt.plan.groups for n in g.names]

    # Gradient accumulation: 2 backward passes per step over half batches.
    model = make_model()
    opt = mergecomp.DistributedOptimizer(make_optimizer("sgd", model), model.named_parameters(),
                                         schedule=2, backward_passes_per_step=2)
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            (nn.functional.mse_loss(model(x[half]), y[half]) / 2).backward()
        opt.step()
    results["accumulated"] = [p.detach().clone() for p in model.parameters()]

    # One backward too many is refused with a clear error.
    try:
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
        results["too_many"] = None
    except RuntimeError as error:
        results["too_many"] = str(error)
    return results


def test_unused_frozen_and_accumulation():
    results = run_ranks(edge_case_worker, 2)
    # Reference for the unused parameter: one process on both ranks' data, where rank 0's
    # samples use the extra head and rank 1's do not; the mean over ranks of per-rank means.
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        losses = [nn.functional.mse_loss(model(batch(step, r)[0], use_extra=(r == 0)), batch(step, r)[1])
                  for r in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
    for rank_result in results:
        for got, want in zip(rank_result["unused"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        assert rank_result["frozen_same"]
        assert not any(n.startswith("frozen") for n in rank_result["plan_names"])
        for got, want in zip(rank_result["accumulated"], reference_params("sgd", 2, 3)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert "backward_passes_per_step=2" in rank_result["too_many"]


def grad_view_worker(rank, world_size):
    """Raw groups hand out views of their buffer as p.grad; kept grads, accumulation and
    in-place clipping must still train exactly like the reference."""
    results = {}
    for set_to_none in (True, False):
        model = make_model()
        opt = mergecomp.DistributedOptimizer(make_optimizer("sgd", model), model.named_parameters(),
                                             schedule=2, backward_passes_per_step=2)
        for step in range(4):
            x, y = batch(step, rank)
            opt.zero_grad(set_to_none=set_to_none)
            for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
                (nn.functional.mse_loss(model(x[half]), y[half]) / 2).backward()
            opt.synchronize()  # a no-op: backward has written the averages
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # in place on the views
            opt.step()
        buffers = [g.buffer for g in opt.reducer.groups]
        results[set_to_none] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "views": all(any(p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                             for b in buffers) for p in model.parameters()),
        }
    return results


def test_raw_groups_write_back_views_of_their_buffer():
    results = run_ranks(grad_view_worker, 2)
    expected = reference_params("sgd", 2, 4)
    for rank_result in results:
        for set_to_none in (True, False):
            assert rank_result[set_to_none]["views"], "p.grad should be a view of the group buffer"
            for got, want in zip(rank_result[set_to_none]["params"], expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def find_unused_worker(rank, world_size):
    model = Branchy()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(), schedule=2,
                                         find_unused_parameters=True)
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x, use_extra=False), y).backward()
        opt.step()
    return model.extra.weight.grad is None, model.head.weight.grad is not None


def test_find_unused_parameters_keeps_globally_unused_grad_none():
    assert run_ranks(find_unused_worker, 2) == [(True, True), (True, True)]


def state_worker(rank, world_size, mode, blob):
    """mode 'full': 6 steps; 'first': 3 steps then save; 'resume': load then 3 steps."""
    model = make_model()
    opt = mergecomp.DistributedOptimizer(
        make_optimizer("sgd", model), model.named_parameters(),
        compressor=mergecomp.compressors.create("randk", compress_ratio=0.3),
        memory="residual", communicator="allreduce", schedule=2)
    steps = range(6) if mode == "full" else range(3) if mode == "first" else range(3, 6)
    if mode == "resume":
        saved = torch.load(io.BytesIO(blob[rank]), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    for step in steps:
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if mode == "first":
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
        return buffer.getvalue()
    return [p.detach().clone() for p in model.parameters()]


def test_state_dict_round_trip_continues_exactly():
    full = run_ranks(state_worker, 2, "full", None)
    saved = run_ranks(state_worker, 2, "first", None)
    resumed = run_ranks(state_worker, 2, "resume", saved)
    for a, b in zip(full, resumed):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def mismatch_worker(rank, world_size):
    model = nn.Linear(4, 3 + rank)
    try:
        mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    except ValueError as error:
        return str(error)
    return None


def test_mismatched_models_fail_on_every_rank():
    messages = run_ranks(mismatch_worker, 2)
    assert all(m is not None and "different models" in m for m in messages)


def bad_input_worker(rank, world_size):
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    try:
        mergecomp.DistributedOptimizer(base, model.named_parameters(), compressor="topk",
                                       communicator="allreduce")
    except ValueError as error:
        errors["allreduce_topk"] = str(error)
    try:
        mergecomp.DistributedOptimizer(base, model.named_parameters(), schedule=-1)
    except ValueError as error:
        errors["fusion"] = str(error)
    return errors


def test_bad_configurations_raise_clear_errors():
    errors = run_ranks(bad_input_worker, 2)[0]
    assert "allgather" in errors["allreduce_topk"] and "'topk'" in errors["allreduce_topk"]
    assert "-1" in errors["fusion"]


def test_unknown_names_and_bad_ratios():
    with pytest.raises(ValueError, match="did you mean 'topk'"):
        mergecomp.compressors.create("topkk")
    with pytest.raises(ValueError, match="available memorys|available memories|residual"):
        mergecomp.memories.create("residul")
    with pytest.raises(ValueError, match="allgather"):
        mergecomp.communicators.get("allgathr")
    for ratio in (0, 1.5, -0.1, "abc"):
        with pytest.raises(ValueError, match=str(ratio)):
            mergecomp.compressors.create("topk", compress_ratio=ratio)
    with pytest.raises(ValueError, match="2"):
        mergecomp.compressors.create("randk", compress_ratio=2)


def byte_counting_worker(rank, world_size):
    backend = mergecomp.distributed.backends.default_backend()
    counts = {}
    for name, op in (
            ("allreduce", lambda: backend.allreduce_async([torch.ones(300)]).wait()),
            ("allgather", lambda: backend.allgather_async([torch.ones(300)], same_shapes=True).wait()),
            ("alltoall", lambda: backend.alltoall([torch.zeros(8 * (r + 1), dtype=torch.uint8)
                                                   for r in range(world_size)]))):
        sent, wire = backend.bytes_sent, backend.wire_bytes
        op()
        counts[name] = (backend.bytes_sent - sent, backend.wire_bytes - wire)
    return counts


def test_backend_counts_handed_and_wire_bytes():
    counts = run_ranks(byte_counting_worker, 3)
    for rank, c in enumerate(counts):
        assert c["allreduce"] == (1200, 1200 * 2 * 2 // 3)   # ring: 2(N-1)/N of the buffer
        assert c["allgather"] == (1200, 1200 * 2)             # ring: N-1 blocks forwarded
        sizes_header = 3 * 8                                  # one int64 size per rank, to all
        chunks = 8 + 16 + 24
        assert c["alltoall"] == (sizes_header + chunks, sizes_header * 2 + chunks - 8 * (rank + 1))


def set_plan_worker(rank, world_size):
    from mergecomp.runtime.regroup import CannotRegroup
    model = make_model()
    opt = mergecomp.DistributedOptimizer(
        make_optimizer("sgd", model), model.named_parameters(),
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.1), schedule=2)
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def per_param(optimizer):
        residuals = optimizer.memory.residuals
        out = {}
        for index, group in enumerate(optimizer.plan.groups):
            flat, offset = residuals[f"group{index}"], 0
            for name in group.names:
                n = dict(model.named_parameters())[name].numel()
                out[name] = flat[offset:offset + n].clone()
                offset += n
        return out

    before = per_param(opt)
    layer_wise = mergecomp.schedulers.create("fixed", fusion_num=0).plan(
        opt.param_infos([n for g in opt.plan.groups for n in g.names]))
    opt.set_plan(layer_wise)
    after = per_param(opt)
    x, y = batch(5, rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # the hooks run the new plan
    same = all(torch.equal(before[n], after[n]) for n in before)
    # Turning every group raw drains the residuals into the next (exact) send.
    residual_mass = sum(float(r.abs().sum()) for r in opt.memory.residuals.values())
    raw = mergecomp.schedulers.create("fixed", fusion_num=1, send="fp32").plan(
        opt.param_infos([n for g in opt.plan.groups for n in g.names]))
    opt.set_plan(raw)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    drained = residual_mass > 0 and not opt.memory.residuals

    # Per-layer PowerSGD keeps its state per parameter view: it follows each view into its
    # new group.  The flat variant's state is one matrix per group: a switch is refused.
    def powersgd_switch(name):
        power_model = make_model()
        power = mergecomp.DistributedOptimizer(torch.optim.SGD(power_model.parameters(), lr=0.1),
                                               power_model.named_parameters(),
                                               compressor=mergecomp.compressors.create(name, rank=2),  # factors these layers
                                               schedule=1)
        nn.functional.mse_loss(power_model(x), y).backward()
        power.step()
        views = lambda: {view: q for group in power.compressor.state_dict()["queries"].values()
                         for view, q in (group.items() if isinstance(group, dict) else [])}
        before = views()
        try:
            power.set_plan(mergecomp.schedulers.create("fixed", fusion_num=0).plan(
                power.param_infos([n for g in power.plan.groups for n in g.names])))
        except CannotRegroup as error:
            return str(error), len(power.plan), None
        after = views()
        kept = bool(before) and before.keys() == after.keys() and all(torch.equal(before[v], after[v]) for v in before)
        power.zero_grad()
        nn.functional.mse_loss(power_model(x), y).backward()
        power.step()  # the new plan runs with the moved state
        return None, len(power.plan), kept

    return same and drained, len(opt.plan), powersgd_switch("powersgd"), powersgd_switch("batched_powersgd")


def powersgd_raw_to_compressed_worker(rank, world_size):
    """A tensor sent raw in one plan and factored in the next starts its PowerSGD state afresh
    beside the tensors whose state moved with them."""
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor=mergecomp.compressors.create("powersgd", rank=2, factor_dtype="fp32"),
                                         schedule=mergecomp.Plan([mergecomp.Group(("4.weight", "4.bias", "2.weight", "2.bias"), "compress"),
                                                                  mergecomp.Group(("0.weight", "0.bias"), "fp32")]))
    for step in range(3):
        if step == 1:
            opt.set_plan(mergecomp.Plan([mergecomp.Group(("4.weight", "4.bias"), "compress"),
                                         mergecomp.Group(("2.weight", "2.bias", "0.weight", "0.bias"), "compress")]))
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return sorted(v for views in opt.compressor.state_dict()["queries"].values() for v in views)


def test_powersgd_state_follows_a_plan_switch_that_compresses_a_raw_tensor():
    for views in run_ranks(powersgd_raw_to_compressed_worker, 2):
        assert views == ["0.weight", "2.weight"]  # 4.weight (3 × 8) is too small to factor


def test_set_plan_moves_error_feedback_state_or_refuses():
    for same, groups, per_layer, batched in run_ranks(set_plan_worker, 2):
        assert same and groups == 1
        refused, power_groups, kept = per_layer
        assert refused is None and power_groups == 6 and kept  # one group per tensor
        refused, power_groups, _ = batched
        assert refused and power_groups == 1


def lr_schedule_worker(rank, world_size):
    """An LR scheduler on the wrapper keeps driving the wrapped optimizer after a resume."""
    def build():
        model = make_model()
        opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             model.named_parameters())
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    model, opt, schedule = build()
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        schedule.step()
    saved = {"opt": opt.state_dict(), "schedule": schedule.state_dict()}
    _, resumed, resumed_schedule = build()
    resumed.load_state_dict(saved["opt"])
    resumed_schedule.load_state_dict(saved["schedule"])
    resumed_schedule.step()
    # A group added to the wrapper lands in the wrapped optimizer and joins the exchange.
    resumed.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    return (resumed.optimizer.param_groups[0]["lr"], resumed.param_groups[0]["lr"],
            len(resumed.optimizer.param_groups), resumed.reducer.added)


def test_lr_scheduler_drives_the_wrapped_optimizer_after_load_state_dict():
    for inner_lr, wrapper_lr, groups, added in run_ranks(lr_schedule_worker, 2):
        assert inner_lr == wrapper_lr == pytest.approx(0.1 * 0.5 ** 3)
        assert groups == 2 and added == ["param.6"]
