"""The plot script renders readable PNGs from a summary.csv (a real smoke sweep's, in fixtures)."""
import os

import pytest

pytest.importorskip("matplotlib")
from benchmarks import plot  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "sweep_summary.csv")


def test_renders_pngs(tmp_path):
    paths = plot.render(FIXTURE, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["itertime_1gbit.png", "scaling_1gbit.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 10_000


def test_cli_writes_next_to_the_csv_by_default(tmp_path):
    csv_path = tmp_path / "summary.csv"
    csv_path.write_text(open(FIXTURE).read())
    assert plot.main([str(csv_path)]) == 0
    assert (tmp_path / "scaling_1gbit.png").exists()


def test_wrong_csv_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    assert plot.main([str(bad), "--out", str(tmp_path)]) == 2
    assert "lacks the column" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot read"):
        plot.read_summary(str(tmp_path / "missing.csv"))


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_shown_runs_draw_from_the_committed_data(tmp_path):
    # what `plot.py results` draws, into tmp_path instead of beside the data
    for run, name in zip(plot.SHOWN_RUNS, ("headline.png", "accuracy.png")):
        folder = os.path.join(RESULTS, run)
        assert os.path.exists(os.path.join(folder, name)), f"{run} has no committed {name}"
        out = tmp_path / run
        out.mkdir()
        [path] = plot.render_any(folder, str(out))
        assert os.path.basename(path) == name and _is_png(path) and os.path.getsize(path) > 20_000


def test_compressor_labels_read_as_in_the_readme():
    assert plot._pretty("dgc:compress_ratio=0.01") == "dgc 1%"
    assert plot._pretty("randk:unbiased=True") == "randk unbiased"
    assert plot._pretty("topk") == "topk"
    assert plot._pretty("dgc:compress_ratio=0.01:warmup_steps=300") == "dgc 1% warmup_steps 300"


def test_wrong_folders_are_clear_errors(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert plot.main([str(tmp_path)]) == 2  # an empty folder: no headline JSON
    assert "no JSON results of benchmarks/headline.py" in capsys.readouterr().err
    (tmp_path / "convergence.json").write_text("[]")
    assert plot.main([str(tmp_path)]) == 2
    assert "no result of benchmarks/convergence.py" in capsys.readouterr().err
    assert plot.main(["results", "--out", str(tmp_path)]) == 2
    assert "beside its data" in capsys.readouterr().err


def test_the_simulator_check_draws_from_its_rounds_results(tmp_path):
    folder = os.path.join(RESULTS, "2026-11-24-simulator-8-ranks")
    assert "2026-11-24-simulator-8-ranks" in plot.SHOWN_RUNS
    [path] = plot.render_any(folder, str(tmp_path))
    assert os.path.basename(path) == "check.png" and _is_png(path)
    with pytest.raises(ValueError, match="no simulator.py rounds results"):
        plot.render_simulator_check(str(tmp_path))
