"""Plans are plain data: JSON round trips, digests, validation errors."""
import pytest

from mergecomp.plan import Group, ParamInfo, Plan

PLAN = Plan([Group(("fc.weight", "fc.bias"), "compress"), Group(("conv.weight",), "fp16")])


def test_json_round_trip_and_save_load(tmp_path):
    assert Plan.from_json(PLAN.to_json()) == PLAN
    assert Plan.from_json(PLAN.to_json(indent=None)).digest() == PLAN.digest()
    path = str(tmp_path / "plan.json")
    PLAN.save(path)
    assert Plan.load(path) == PLAN


def test_digests_equal_iff_plans_equal():
    same = Plan([Group(["fc.weight", "fc.bias"]), Group(("conv.weight",), "fp16")])
    assert same == PLAN and same.digest() == PLAN.digest()
    different = [
        Plan([Group(("fc.bias", "fc.weight")), Group(("conv.weight",), "fp16")]),  # member order
        Plan([Group(("fc.weight", "fc.bias"), "fp32"), Group(("conv.weight",), "fp16")]),  # send
        Plan([Group(("conv.weight",), "fp16"), Group(("fc.weight", "fc.bias"))]),  # group order
        Plan([Group(("fc.weight",)), Group(("fc.bias",)), Group(("conv.weight",), "fp16")]),  # cuts
    ]
    digests = {p.digest() for p in different}
    assert len(digests) == len(different) and PLAN.digest() not in digests


def test_validate_names_what_is_wrong():
    PLAN.validate(["conv.weight", "fc.bias", "fc.weight"])
    with pytest.raises(ValueError, match=r"missing parameters \['extra'\]"):
        PLAN.validate(["conv.weight", "fc.bias", "fc.weight", "extra"])
    with pytest.raises(ValueError, match=r"unknown parameters \['conv.weight'\]"):
        PLAN.validate(["fc.bias", "fc.weight"])
    twice = Plan([Group(("a",)), Group(("a", "b"))])
    with pytest.raises(ValueError, match="'a' in groups 0 and 1"):
        twice.validate(["a", "b"])


def test_malformed_plans_and_groups_are_refused():
    with pytest.raises(ValueError, match="not a mergecomp plan"):
        Plan.from_dict({"layers": []})
    with pytest.raises(ValueError, match="send mode must be one of"):
        Group(("a",), "gzip")
    with pytest.raises(ValueError, match="at least one parameter"):
        Group(())


def test_describe_lists_groups_with_sizes():
    text = PLAN.describe([ParamInfo("fc.weight", 250_000), ParamInfo("fc.bias", 250_000),
                          ParamInfo("conv.weight", 10)])
    assert PLAN.digest() in text and "2.00 MB, send=compress" in text and "send=fp16" in text
