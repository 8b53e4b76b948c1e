"""What the entry points accept as compressor, memory, communicator and schedule, checked in
one place (``mergecomp.arguments``) so that the wrapper, the DDP hook and the benchmark CLI
refuse the same mistakes, at construction, with the same words."""
import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp import arguments, compressors
from tests.distributed import run_ranks

WRONG_TYPES = [  # (keyword, value, what the message must say)
    ("compressor", 123, r"compressor must be a registered name .* or a mergecomp.compressors.Compressor "
                        r"instance, e.g. mergecomp.compressors.create\('topk', compress_ratio=0.01\); got 123 \(int\)"),
    ("compressor", compressors.get("topk"), r"compressor=TopKCompressor is a class: pass an instance"),
    ("memory", 4.5, r"memory must be 'auto' .* a registered name .* or a mergecomp.memories.Memory "
                    r"instance.*; got 4.5 \(float\)"),
    ("communicator", ["allgather"], r"communicator must be a registered name .*; got \['allgather'\] \(list\)"),
]


@pytest.mark.parametrize("keyword,value,message", WRONG_TYPES)
def test_resolve_names_the_argument_the_value_and_the_accepted_forms(keyword, value, message):
    given = dict(compressor="topk", memory="auto", communicator="auto")
    given[keyword] = value
    with pytest.raises(TypeError, match=message):
        arguments.resolve(**given)


def test_a_compressor_with_its_own_error_feedback_declares_it():
    assert compressors.get("powersgd").error_feedback and compressors.get("batched_powersgd").error_feedback
    assert not compressors.create("powersgd", use_error_feedback=False).error_feedback
    others = [n for n in compressors.available() if n not in ("powersgd", "batched_powersgd")]
    assert not any(compressors.get(n).error_feedback for n in others)


@pytest.mark.parametrize("compressor,memory,message", [
    ("powersgd", "residual", "keeps its own error feedback, so the 'residual' memory would feed each error back "
                             "a second time: pass memory='none' or 'auto'"),
    ("batched_powersgd", "dgc", "keeps its own error feedback, so the 'dgc' memory"),
    (compressors.create("powersgd", use_error_feedback=False), "residual",
     "exchanges in several rounds, which a memory never sees, so the 'residual' memory would silently do nothing"),
])
def test_a_memory_the_compressor_cannot_pair_with_is_refused(compressor, memory, message):
    with pytest.raises(ValueError, match=message):
        arguments.resolve(compressor, memory, "auto")


def test_what_each_compressor_pairs_with_by_default_is_accepted():
    for name in compressors.available():
        arguments.resolve(name, "auto", "auto")
    arguments.resolve("powersgd", "none", "allreduce")
    arguments.resolve("dgc", "residual", "allgather")  # DGC's paper allows plain error feedback


def test_bucket_caps_refuses_a_schedule_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"schedule must be a fusion-num \(int\), a scheduler name or a "
                                        r"Scheduler; got 4.5 \(float\)"):
        mergecomp.ddp.bucket_caps(nn.Linear(2, 2), 4.5)


def entry_points_worker(rank, world_size):
    """Every wrong argument at construction of the wrapper and of the DDP hook: the error."""
    from torch.nn.parallel import DistributedDataParallel
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    cases = [dict(compressor=123), dict(memory=4.5), dict(communicator=["allgather"]),
             dict(compressor="powersgd", memory="residual")]
    seen = []
    for case in cases:
        for build in (lambda: mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                             model=model, **case),
                      lambda: mergecomp.ddp.register(ddp, **case)):
            try:
                build()
                seen.append(None)
            except (TypeError, ValueError) as error:
                seen.append((type(error).__name__, str(error)))
    try:
        mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, schedule=2.5)
    except TypeError as error:
        seen.append(("TypeError", str(error)))
    return seen


def test_the_wrapper_and_the_hook_refuse_the_same_arguments_at_construction():
    seen, _ = run_ranks(entry_points_worker, 2)
    wrapper, hook = seen[0:8:2], seen[1:8:2]
    assert wrapper == hook  # the same check, the same words
    kinds = [kind for kind, _ in wrapper]
    assert kinds == ["TypeError", "TypeError", "TypeError", "ValueError"]
    assert "got 123 (int)" in wrapper[0][1] and "got 4.5 (float)" in wrapper[1][1]
    assert "got ['allgather'] (list)" in wrapper[2][1] and "own error feedback" in wrapper[3][1]
    assert seen[8][0] == "TypeError" and "schedule must be" in seen[8][1] and "2.5" in seen[8][1]
