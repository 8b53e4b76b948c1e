"""The examples: their command lines as a user types them."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name, *flags, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("name, words", [
    ("train_classifier.py", ["--checkpoint", "--resume"]),
])
def test_help(name, words):
    done = run_script(name, "--help", timeout=120)
    assert done.returncode == 0, done.stderr
    for word in words:
        assert word in done.stdout


def test_classifier_checkpoints_default_to_an_ignored_folder():
    module = load_example("train_classifier")
    assert module.DEFAULT_CHECKPOINT == os.path.join(ROOT, "runs", "train_classifier")
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/runs/" in f.read().split()
