"""The convergence benchmark's DiLoCo family, small: a tiny character LSTM, 2 gloo ranks;
DiLoCo rows train, send about 1/H of dense's bytes, are evaluated at the anchor and record
their outer settings; bad specs are refused with the part that is wrong."""
import pytest
import torch

from benchmarks import convergence
from benchmarks.harness import lm, lowcomm
from tests.distributed import run_ranks
from benchmarks.tests.test_convergence_lm import OPTIONS, TINY

LABELS = ("diloco:H=4", "diloco:H=4:compressor=sparseloco:chunk=64:topk=4")


def _train_rows(rank, world_size):
    torch.set_num_threads(1)
    lm.TASKS[TINY.name] = TINY
    corpus = convergence.load_task_data(OPTIONS)
    specs = [convergence.parse_spec(convergence.DENSE)] + [lowcomm.parse(label) for label in LABELS]
    return {spec.label: convergence.train_lm(spec, 0, OPTIONS, corpus, rank, world_size) for spec in specs}


@pytest.fixture(scope="module")
def rows():
    return run_ranks(_train_rows, 2, timeout=240)[0]


@pytest.mark.parametrize("label", LABELS)
def test_diloco_rows_learn_and_send_less(rows, label):
    dense, mine = rows[convergence.DENSE], rows[label]
    assert not mine["diverged"], mine["curve"]
    assert mine["curve"][-1]["valid_loss"] < 0.8 * mine["curve"][0]["valid_loss"], mine["curve"]
    assert mine["bytes_per_step"] < dense["bytes_per_step"] / 3
    assert mine["sync_every"] == 4 and mine["outer_lr"] > 0 and mine["clip_mode"] == "inner"
    assert mine["epochs_run"] == rows[convergence.DENSE]["epochs_run"] >= 1


def test_the_table_says_what_diloco_rows_share(rows):
    text = lowcomm.note(list(rows.values()))
    assert "inner optimizer" in text and "anchor" in text


def test_specs_are_parsed_and_bad_ones_refused():
    spec = lowcomm.parse("H=8:fragments=2:overlap=1:outer_momentum=0.5:compressor=topk:compress_ratio=0.03")
    assert spec.label == "diloco:H=8:fragments=2:overlap=1:outer_momentum=0.5:compressor=topk:compress_ratio=0.03"
    assert spec.sync_every == 8 and spec.diloco == dict(fragments=2, overlap=1, outer_momentum=0.5)
    assert spec.compressor == "topk" and spec.kwargs == dict(compress_ratio=0.03)
    with pytest.raises(ValueError, match="must start with H="):
        lowcomm.parse("fragments=2")
    with pytest.raises(ValueError, match="fragments must be int, got '1.5'"):
        lowcomm.parse("H=8:fragments=1.5")
    with pytest.raises(ValueError, match="topkk"):
        lowcomm.parse("H=8:compressor=topkk")
    args = convergence.parse_args(["--diloco", "H=8", "H=32", "--seeds", "0"])
    assert [s.label for s in args.specs] == [convergence.DENSE, "diloco:H=8", "diloco:H=32"]


def test_the_headline_times_diloco_over_windows_that_every_h_divides(capsys):
    from benchmarks import headline
    args = headline.parse_matrix(["--window", "16", "--diloco", "H=8", "H=16:compressor=sparseloco"])
    assert [s.label for s in args.diloco_specs] == ["diloco:H=8", "diloco:H=16:compressor=sparseloco"]
    with pytest.raises(SystemExit):
        headline.parse_matrix(["--window", "3", "--diloco", "H=8"])
    assert "--window 3 is not a multiple of H for ['diloco:H=8']" in capsys.readouterr().err


def test_the_committed_run_draws_loss_against_time(tmp_path):
    pytest.importorskip("matplotlib")
    import os
    from benchmarks import plot
    folder = os.path.join(plot.ROOT, "benchmarks", "results", "2026-11-24-lowcomm-speed")
    assert "2026-11-24-lowcomm-speed" in plot.SHOWN_RUNS
    figure, table = plot.render_any(folder, str(tmp_path))
    assert os.path.basename(figure) == "loss-vs-time.png" and os.path.getsize(figure) > 20_000
    with open(table) as f, open(os.path.join(folder, "time-to-target.md")) as committed:
        assert f.read() == committed.read()  # the committed table is what the committed data gives
