"""The real-data examples on tiny datasets written in the real formats (nothing downloads).

One short training run of each example on 2 gloo ranks through its own loading code, a
resume from per-rank checkpoints, flag errors, and the command lines as a user types them.
"""
import contextlib
import io
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.tests.dataset_files import WIKI_WORDS, write_cifar, write_wikitext
from tests.distributed import run_ranks
from tests.examples import load_example

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def run_example(rank, world_size, name, argv):
    """On each rank: parse the example's flags and train, returning (result, rank 0's output)."""
    module = load_example(name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = module.train(module.parse_args(argv))
    return result, printed.getvalue()


# ----------------------------------------------------------------------------- the examples

CIFAR_FLAGS = ["--epochs", "2", "--batch-size", "8", "--eval-batch-size", "7",
               "--lr-warmup-epochs", "1", "--fusion-num", "2"]


def test_cifar_example_trains_an_epoch_on_two_ranks(tmp_path):
    write_cifar(tmp_path)
    results = run_ranks(run_example, 2, "train_cifar10",
                        ["--data-dir", str(tmp_path), *CIFAR_FLAGS, "--stop-after-epoch", "0"],
                        timeout=120)
    (result, printed), (other, silent) = results
    assert result == other and silent == ""
    assert result["epochs_run"] == 1 and math.isfinite(result["train_loss"])
    assert 0 <= result["test_accuracy"] <= 1
    # DGC in the first epoch of its warm-up sends 25% of the elements, 2 bytes each on the
    # tight wire "auto" picks at that density (value, 8-bit offset within a block of 255),
    # plus a byte of count per block and a scale per group
    assert 0.25 * 2 * 269_722 < result["bytes_per_step"] < 0.26 * 2 * 269_722
    assert "64 training images (2 batches), 16 test images" in printed
    assert "DGCCompressor(compress_ratio=0.001, warmup=4" in printed
    assert "momentum 0.9 in the memory, SGD without; weight decay 0.001 (= 0.0001 / (1 - 0.9)" in printed
    assert "epoch 0: train loss" in printed and "test accuracy" in printed
    assert "density 0.25" in printed and "bytes/step per worker" in printed


def test_cifar_example_resumes_from_its_checkpoints_exactly(tmp_path):
    write_cifar(tmp_path / "data")
    common = ["--data-dir", str(tmp_path / "data"), *CIFAR_FLAGS, "--batch-size", "16",
              "--depth", "8", "--compressor", "topk", "--compress-ratio", "0.05"]
    straight = run_ranks(run_example, 2, "train_cifar10", common, timeout=120)[0][0]
    folder = str(tmp_path / "ckpt")
    run_ranks(run_example, 2, "train_cifar10",
              common + ["--checkpoint", folder, "--stop-after-epoch", "0"], timeout=120)
    assert sorted(os.listdir(folder)) == ["rank0.pt", "rank1.pt"]
    state = torch.load(os.path.join(folder, "rank1.pt"), weights_only=True)
    assert state["epoch"] == 0 and state["world_size"] == 2
    assert state["optimizer"]["mergecomp"]["plan"] is not None
    (resumed, printed), _ = run_ranks(run_example, 2, "train_cifar10",
                                      common + ["--checkpoint", folder], timeout=120)
    assert "resumed from" in printed and resumed["epochs_run"] == 1
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["test_accuracy"] == straight["test_accuracy"]


@pytest.mark.parametrize("flags, clipping", [
    ([], "averaged gradient clipped to norm 0.25"),
    (["--compressor", "dgc", "--momentum", "0.9", "--compress-ratio", "0.05"],
     "local clipping to 0.25/sqrt(2) in the dgc memory"),
])
def test_language_model_example_trains_an_epoch_on_two_ranks(tmp_path, flags, clipping):
    write_wikitext(tmp_path)
    argv = ["--data-dir", str(tmp_path), "--epochs", "1", "--hidden-size", "16",
            "--batch-size", "2", "--eval-batch-size", "2", "--bptt", "6", "--lr", "2", *flags]
    (result, printed), (other, _) = run_ranks(run_example, 2, "train_language_model", argv,
                                              timeout=120)
    assert result == other
    assert math.isfinite(result["train_loss"]) and result["bytes_per_step"] > 0
    vocabulary = len(WIKI_WORDS) - 1 + 4  # "the" twice; <unk>, <eos>, "=", "Section"
    # an untrained model is near uniform: perplexity about the vocabulary size
    assert 0.5 * vocabulary < result["valid_perplexity"] < 2 * vocabulary
    assert 0.5 * vocabulary < result["test_perplexity"] < 2 * vocabulary
    assert f"vocabulary {vocabulary}" in printed and clipping in printed
    assert "valid perplexity" in printed and "test perplexity" in printed
    assert "bytes/step per worker" in printed


# ----------------------------------------------------------------------------- command lines

def run_script(name, *flags, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("name, words", [
    ("train_cifar10.py", ["--data-dir", "--checkpoint", "--density-warmup-epochs", "--nproc"]),
    ("train_language_model.py", ["--data-dir", "--bptt", "--clip", "--compressor", "--nproc"]),
    ("train_classifier.py", ["--checkpoint", "--resume"]),
])
def test_help(name, words):
    done = run_script(name, "--help", timeout=120)
    assert done.returncode == 0, done.stderr
    for word in words:
        assert word in done.stdout


def test_bad_flags_fail_before_any_worker_starts(tmp_path, capsys):
    cifar_example, language_example = load_example("train_cifar10"), load_example("train_language_model")
    with pytest.raises(SystemExit) as exit:
        cifar_example.parse_args(["--data-dir", str(tmp_path), "--nproc", "2"])
    error = capsys.readouterr().err
    assert exit.value.code == 2 and "no CIFAR-10 batches" in error and "cifar-10-python.tar.gz" in error
    write_cifar(tmp_path)
    for flags, message in [
        (["--compressor", "topk", "--density-warmup-epochs", "2"], "does not apply to --compressor topk"),
        (["--compressor", "signsgd", "--compress-ratio", "0.1"], "takes no ratio"),
        (["--compressor", "topkk"], "did you mean 'topk'"),
        (["--depth", "21"], "6n+2"),
        (["--lr-warmup-epochs", "300"], "--lr-warmup-epochs must be in [0, --epochs=200)"),
    ]:
        with pytest.raises(SystemExit):
            cifar_example.parse_args(["--data-dir", str(tmp_path), *flags])
        assert message in capsys.readouterr().err
    write_wikitext(tmp_path)
    with pytest.raises(SystemExit):
        language_example.parse_args(["--data-dir", str(tmp_path), "--comm", "allreduce"])
    assert "use --comm allgather or --comm ps" in capsys.readouterr().err


def test_cifar_example_from_the_command_line_with_nproc(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py")
    done = run_script("train_cifar10.py", "--data-dir", str(tmp_path), "--nproc", "2",
                      "--epochs", "1", "--batch-size", "16", "--lr-warmup-epochs", "0")
    assert done.returncode == 0, done.stderr
    assert "2 worker(s) (spawn) on cpu" in done.stdout
    assert "epoch 0: train loss" in done.stdout and "bytes/step per worker" in done.stdout


def test_classifier_checkpoints_default_to_an_ignored_folder():
    module = load_example("train_classifier")
    assert module.DEFAULT_CHECKPOINT == os.path.join(ROOT, "runs", "train_classifier")
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/runs/" in f.read().split()


# ----------------------------------------------------------------------------- --help

class _Parsed(Exception):
    """Raised in place of parsing: the parser a script built, caught before it runs."""


def test_every_flag_of_every_example_says_what_it_does(monkeypatch):
    """``--help`` of each example describes every flag (an argparse action without help)."""
    import argparse
    import runpy
    parsers = {}

    def capture(parser, args=None, namespace=None):
        parsers[script] = parser
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    for script in sorted(os.listdir(EXAMPLES)):
        if not script.endswith(".py"):
            continue
        monkeypatch.setattr(sys, "argv", [script])
        try:
            runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
        except _Parsed:
            pass
    assert {"train_classifier.py", "train_cifar10.py", "train_language_model.py", "accelerate_ddp.py",
            "lightning_ddp.py"} <= set(parsers)
    silent = {script: [a.option_strings or a.dest for a in parser._actions if a.help is None]
              for script, parser in parsers.items()}
    assert not any(silent.values()), f"flags without a description in --help: {silent}"
