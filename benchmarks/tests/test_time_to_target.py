"""Time to a target validation loss: steps to the target (linear between evaluations) times
the measured step time, and the table the low-communication results carry."""
import pytest

from benchmarks.harness import lowcomm


def _curve(*points):
    return [{"step": step, "valid_loss": loss} for step, loss in points]


DENSE = _curve((0, 4.0), (40, 3.0), (80, 2.0), (120, 1.5))


def test_the_crossing_is_interpolated_between_evaluations():
    assert lowcomm.steps_to_target(DENSE, 2.5) == pytest.approx(60.0)
    assert lowcomm.steps_to_target(DENSE, 3.0) == pytest.approx(40.0)
    assert lowcomm.steps_to_target(DENSE, 5.0) == 0.0
    assert lowcomm.steps_to_target(DENSE, 1.0) is None
    assert lowcomm.time_to_target(DENSE, 0.5, 2.5) == pytest.approx(30.0)
    assert lowcomm.time_to_target(DENSE, 0.5, 1.0) is None


def test_the_first_crossing_counts_even_if_the_curve_goes_up_again():
    bumpy = _curve((0, 4.0), (10, 2.0), (20, 3.0), (30, 1.0))
    assert lowcomm.steps_to_target(bumpy, 2.0) == pytest.approx(10.0)


def test_loss_at_and_the_mean_of_seeds():
    assert lowcomm.loss_at(DENSE, 90) == pytest.approx(1.875)
    mean = lowcomm.mean_curve([DENSE, _curve((0, 2.0), (40, 1.0), (80, 1.0), (120, 0.5), (160, 0.1))])
    assert [p["step"] for p in mean] == [0, 40, 80, 120] and mean[1]["valid_loss"] == pytest.approx(2.0)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="outside the curve"):
        lowcomm.loss_at(DENSE, 200)
    with pytest.raises(ValueError, match="different steps"):
        lowcomm.mean_curve([DENSE, _curve((0, 4.0), (50, 3.0))])
    with pytest.raises(ValueError, match="positive number of seconds"):
        lowcomm.time_to_target(DENSE, 0.0, 2.5)


def test_the_table_gives_time_and_ratio_per_link():
    curves = {"fp16": DENSE, "diloco:H=8": _curve((0, 4.0), (40, 2.5), (80, 2.0)), "never": _curve((0, 4.0), (40, 3.9))}
    timed = {"fp16": "ddp-fp16", "diloco:H=8": "diloco:H=8"}
    cells = {"1gbit": {"ddp-fp16": 1.0, "diloco:H=8": 0.5}, "10gbit": {"ddp-fp16": 0.5, "diloco:H=8": 0.5}}
    table = lowcomm.time_to_target_table(curves, timed, cells, 2.5, "fp16").splitlines()
    assert table[0].startswith("| method | timed as | steps to target | s/step 1gbit")
    # fp16: 60 steps (1gbit: 60 s, 10gbit: 30 s); DiLoCo: 40 steps (20 s, 20 s)
    assert table[2] == "| fp16 | ddp-fp16 | 60 | 1.000 | 60 | 1.00 | 0.500 | 30 | 1.00 |"
    assert table[3] == "| diloco:H=8 | diloco:H=8 | 40 | 0.500 | 20 | 0.33 | 0.500 | 20 | 0.67 |"
    assert table[4] == "| never | not timed | not reached |  |  |  |  |  |  |"
