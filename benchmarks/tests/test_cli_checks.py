"""compress_benchmark.py's checks of its flags, before any rank starts."""
import pytest

import compress_benchmark


def test_the_benchmark_cli_refuses_the_pairing_before_starting_a_rank():
    args = compress_benchmark.parse_args(["--compress", "--compressor", "powersgd", "--memory", "residual"])
    with pytest.raises(ValueError, match="keeps its own error feedback"):
        compress_benchmark.check_names(args)


def test_compress_benchmark_takes_a_timeout_flag(capsys):
    import compress_benchmark
    assert compress_benchmark.parse_args(["--timeout", "30"]).timeout == 30.0
    assert compress_benchmark.parse_args([]).timeout is None
    for bad in ("0", "-5", "inf"):
        with pytest.raises(SystemExit) as raised:
            compress_benchmark.parse_args(["--timeout", bad])
        assert raised.value.code == 2
        assert "--timeout must be a positive number of seconds" in capsys.readouterr().err
