"""convergence.py's flags for how the user trains: defaults that follow the task and the
optimizer, every bad value refused with what to do, the issue's setting reproduced."""
import pytest

from benchmarks import convergence
from benchmarks.harness import drift, optimizers


def _error(capsys, argv):
    with pytest.raises(SystemExit):
        convergence.parse_args(argv)
    return capsys.readouterr().err


def test_the_untuned_models_setting_parses_as_written():
    args = convergence.parse_args(
        ["--task", "char-lstm", "--embedding", "64", "--hidden", "192", "--layers", "2", "--batch-size", "12",
         "--lr", "0.5", "--momentum", "0.9", "--clip", "1", "--lr-schedule", "cosine", "--steps", "1500",
         "--set-epoch-every", "37", "--workers", "4"])
    assert (args.optimizer, args.lr_schedule, args.set_epoch_every, args.batch_size) == ("sgd", "cosine", 37, 12)
    assert (args.embedding, args.hidden, args.layers, args.weight_decay) == (64, 192, 2, 0.0)
    assert (args.corpus, args.level, args.controller) == ("pydoc", "char", None)


def test_the_task_chooses_its_corpus_and_level():
    args = convergence.parse_args(["--task", "word-lstm", "--lr", "2"])
    assert (args.corpus, args.level) == ("kjv", "word")
    assert convergence.parse_args(["--task", "word-lstm", "--lr", "2", "--corpus", "pydoc"]).corpus == "pydoc"


def test_adamw_takes_the_swept_defaults_or_asks_for_an_lr(capsys, monkeypatch):
    monkeypatch.setitem(optimizers.DENSE_LR["adamw"], "char-lstm", 0.004)
    monkeypatch.setitem(optimizers.ADAMW_SETTINGS, "char-lstm", dict(weight_decay=0.05, betas=(0.9, 0.95)))
    args = convergence.parse_args(["--task", "char-lstm", "--optimizer", "adamw"])
    assert (args.lr, args.weight_decay, tuple(args.betas)) == (0.004, 0.05, (0.9, 0.95))
    args = convergence.parse_args(["--task", "char-lstm", "--optimizer", "adamw", "--betas", "0.8,0.99",
                                   "--weight-decay", "0"])
    assert (args.weight_decay, tuple(args.betas)) == (0.0, (0.8, 0.99))
    monkeypatch.delitem(optimizers.DENSE_LR["adamw"], "char-lstm")
    assert "no swept dense learning rate under --optimizer adamw" in _error(
        capsys, ["--task", "char-lstm", "--optimizer", "adamw"])


@pytest.mark.parametrize("argv, said", [
    (["--betas", "0.9,0.99"], "--betas 0.9,0.99 is AdamW's"),
    (["--optimizer", "adamw", "--lr", "0.001", "--betas", "0.9"], "got '0.9'"),
    (["--weight-decay", "-1"], "--weight-decay must be ≥ 0, got -1"),
    (["--set-epoch-every", "-2"], "got -2"),
    (["--task", "char-gpt", "--hidden", "130"], "multiple of 4, got 130"),
    (["--task", "digits", "--layers", "3"], "trains a fixed CNN"),
    (["--lr-schedule", "linear"], "invalid choice: 'linear'"),
])
def test_bad_values_are_parser_errors_that_name_them(capsys, argv, said):
    assert said in _error(capsys, argv)


def test_the_controller_flag_is_refused_by_a_mergecomp_without_it(capsys, monkeypatch):
    monkeypatch.setattr(drift, "supported", lambda entry=None: False)
    assert "takes no 'controller' keyword" in _error(capsys, ["--controller", "on"])
    assert convergence.parse_args([]).controller is None  # the library's default needs nothing


def test_the_controller_flag_becomes_the_entry_points_keyword(monkeypatch):
    monkeypatch.setattr(drift, "supported", lambda entry=None: True)
    assert drift.keywords("on") == {"controller": "auto"}
    assert drift.keywords("off") == {"controller": "off"}
    assert drift.keywords(None) == {}
    with pytest.raises(ValueError, match="got 'maybe'"):
        drift.keywords("maybe")


def test_runs_of_older_files_combine_with_the_new_settings_at_their_defaults(tmp_path):
    import json
    old = {"options": {"task": "char-lstm", "lr": 2.0}, "workers": 2, "specs": [], "errors": [],
           "runs": [dict(label="none", seed=0, valid_loss=1.0)]}
    new = {"options": {"task": "char-lstm", "lr": 2.0, "optimizer": "sgd", "betas": [0.9, 0.999],
                       "lr_schedule": "constant", "controller": None}, "workers": 2, "specs": [],
           "errors": [], "runs": [dict(label="topk", seed=0, valid_loss=1.1)]}
    paths = []
    for name, data in (("old", old), ("new", new)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(data, f)
    assert all(convergence._setting(old, key) == convergence._setting(new, key)
               for key in convergence.SHARED_SETTINGS)
