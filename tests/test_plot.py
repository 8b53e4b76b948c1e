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
