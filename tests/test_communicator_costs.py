"""Each communicator prices its own compressed groups; one that declares no formula is
refused by the cost-model schedulers, never priced as another."""
import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.communicators.allgather import AllgatherCommunicator
from mergecomp.planning.costmodel import (NoCostFormula, communicator_formula, predict, priced_collectives,
                                 send_costs)
from tests.distributed import run_ranks
from mergecomp.plan import Group, Plan
from tests.test_costmodel import hand_profile

ONE_COMPRESSED = Plan([Group(("a", "b", "c"), "compress")])


def test_the_built_in_communicators_price_themselves():
    for name in ("allreduce", "allgather", "ps"):
        cls = communicator_formula(name)
        assert cls is mergecomp.communicators.get(name)
        assert send_costs(hand_profile(communicator=name))["compress"] == cls.send_cost(
            hand_profile().codecs["toy"], hand_profile(communicator=name))
    assert priced_collectives("allreduce") == ("allreduce",)
    assert priced_collectives("allgather") == ("allgather",)
    assert priced_collectives("ps") == ("alltoall", "allgather")
    assert priced_collectives("no-such-communicator") == ()
    with pytest.raises(ValueError, match="unknown communicator 'allgathr': did you mean 'allgather'"):
        communicator_formula("allgathr")


class TwiceTheGather(AllgatherCommunicator):
    """A plugin that prices its groups by its own formula: allgather's, sent twice."""

    @classmethod
    def send_cost(cls, codec, profile):
        import dataclasses
        cost = super().send_cost(codec, profile)
        return dataclasses.replace(cost, collective=cost.collective + cost.collective)


class Unpriced(AllgatherCommunicator):
    """A plugin that says nothing of its cost."""

    send_cost = None
    cost_collectives = ()


def plugin_worker(rank, world_size, name):
    mergecomp.communicators.register("twice-the-gather")(TwiceTheGather)
    mergecomp.communicators.register("unpriced")(Unpriced)
    if name == "formulas":  # no collective: rank 0's answers
        gather = send_costs(hand_profile(communicator="allgather"))["compress"]
        twice = send_costs(hand_profile(communicator="twice-the-gather"))["compress"]
        slower = predict(ONE_COMPRESSED, hand_profile(communicator="twice-the-gather")).iteration_time > \
            predict(ONE_COMPRESSED, hand_profile(communicator="allgather")).iteration_time
        refusals = []
        for attempt in (lambda: send_costs(hand_profile(communicator="unpriced")),
                        lambda: mergecomp.schedulers.create("optimal", profile=hand_profile(communicator="unpriced"))):
            try:
                attempt()
            except NoCostFormula as error:
                refusals.append(str(error))
        return (twice.collective == gather.collective + gather.collective, slower, refusals,
                priced_collectives("twice-the-gather"), priced_collectives("unpriced"))
    # The auto scheduler refuses at the end of the first step, on every rank alike.
    model = nn.Linear(8, 2)
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                         compressor=mergecomp.compressors.create("topk", compress_ratio=0.5),
                                         communicator="unpriced",
                                         schedule=mergecomp.schedulers.create("auto", log=None))
    model(torch.ones(4, 8)).sum().backward()
    try:
        opt.step()
    except NoCostFormula as error:
        return str(error)
    return None


def test_a_plugin_communicator_is_priced_by_its_own_formula_or_refused():
    same, slower, refusals, twice_kinds, unpriced_kinds = run_ranks(plugin_worker, 1, "formulas")[0]
    assert same and slower
    assert len(refusals) == 2
    for message in refusals:
        assert "communicator 'unpriced'" in message and "declares no cost formula" in message
        assert "send_cost(cls, codec, profile)" in message and "'binary'" in message
    assert twice_kinds == ("allgather",) and unpriced_kinds == ()


def test_auto_refuses_a_communicator_without_a_cost_formula_on_every_rank():
    for message in run_ranks(plugin_worker, 2, "auto"):
        assert message is not None and "communicator 'unpriced'" in message and "send_cost" in message


def test_communicators_and_the_cost_model_share_a_leaf_not_each_other():
    """Communicators build their SendCost from mergecomp.communicators.cost; the cost model looks
    communicators up.  Neither half is imported back: each imports alone, in either order."""
    import ast
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(mergecomp.__file__).parent
    for path in sorted((root / "communicators").glob("*.py")):
        found = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)]
        imported = {node.module or "" for node in found}
        assert not any(m.endswith("costmodel") for m in imported), f"{path.name} imports the cost model"
        if path.name == "cost.py":  # a leaf: nothing of the package
            assert not any(node.level or (node.module or "").startswith("mergecomp") for node in found), \
                "communicators/cost.py imports the package"
    for first in ("mergecomp.communicators", "mergecomp.planning.costmodel", "mergecomp.communicators.cost"):
        subprocess.run([sys.executable, "-c", f"import {first}; import mergecomp.planning.costmodel"], check=True)
