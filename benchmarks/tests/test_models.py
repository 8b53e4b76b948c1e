"""Benchmark models: lookup, sizes against the papers, one training step on tiny batches."""
import pytest
import torch

from benchmarks.harness import models
from benchmarks.harness.models import count_parameters


def test_available_lists_every_model():
    assert models.available() == ["lstm", "mlp", "resnet20", "resnet50", "transformer", "vgg16"]


def test_unknown_name_suggests_the_closest_match():
    with pytest.raises(ValueError, match=r"unknown model 'resnet2'.*'resnet20'.*lstm, mlp, resnet20"):
        models.get("resnet2")


@pytest.mark.parametrize("name, low, high", [
    ("resnet20", 0.26e6, 0.28e6),     # He et al. 2016, table 6: 0.27M
    ("resnet50", 25.5e6, 25.6e6),     # 25,557,032 with 1000 classes
    ("vgg16", 14.5e6, 15.3e6),        # CIFAR VGG-16 with BatchNorm: 14.7M
    ("lstm", 19.7e6, 19.9e6),         # Zaremba et al. medium (650): 19.8M
    ("transformer", 8e6, 9e6),
    ("mlp", 4207626, 4207626),        # 1024 → 2048 → 1024 → 10
])
def test_parameter_counts_match_the_references(name, low, high):
    assert low <= count_parameters(models.get(name).build()) <= high


def test_large_lstm_option():
    model = models.get("lstm").build(hidden_size=1500)
    assert 65e6 < count_parameters(model) < 67e6  # Zaremba et al. large: 66M
    assert model.drop.p == 0.65


@pytest.mark.parametrize("name, batch_kwargs, build_kwargs, unit", [
    ("resnet20", {}, {}, "img"),
    ("vgg16", {}, {}, "img"),
    ("resnet50", {"image_size": 64}, {}, "img"),
    ("lstm", {"vocab_size": 100}, {"vocab_size": 100, "hidden_size": 32}, "seq"),
    ("transformer", {"vocab_size": 100, "seq_len": 16},
     {"vocab_size": 100, "d_model": 32, "num_layers": 2}, "seq"),
    ("mlp", {"width": 16}, {"width": 16}, "sample"),
])
def test_forward_backward_on_a_tiny_batch(name, batch_kwargs, build_kwargs, unit):
    torch.manual_seed(0)
    spec = models.get(name)
    assert spec.name == name and spec.unit == unit and spec.default_batch_size >= 1
    model = spec.build(**build_kwargs)
    inputs, targets = spec.batch(2, device="cpu", **batch_kwargs)
    loss = spec.loss(model(inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient (data parallelism would stall): {missing}"


def test_batches_are_deterministic_and_follow_the_generator():
    spec = models.get("resnet20")
    first, labels = spec.batch(4)
    again, labels_again = spec.batch(4)
    assert torch.equal(first, again) and torch.equal(labels, labels_again)
    assert first.shape == (4, 3, 32, 32) and labels.shape == (4,) and labels.max() < 10
    other = torch.Generator().manual_seed(1)
    assert not torch.equal(spec.batch(4, generator=other)[0], first)


def test_language_model_targets_are_the_next_tokens():
    inputs, targets = models.get("lstm").batch(3)
    assert inputs.shape == targets.shape == (3, 35)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 10000


def test_lstm_steps_are_independent_of_previous_batches():
    spec = models.get("lstm")
    model = spec.build(vocab_size=50, hidden_size=16).eval()
    inputs, _ = spec.batch(2, vocab_size=50)
    before = model(inputs)
    model(spec.batch(2, vocab_size=50, generator=torch.Generator().manual_seed(5))[0])
    assert torch.equal(model(inputs), before)


def test_transformer_is_causal():
    model = models.get("transformer").build(vocab_size=50, d_model=32, num_layers=2).eval()
    tokens = torch.randint(50, (1, 10))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % 50
    assert torch.allclose(model(tokens)[:, :-1], model(changed)[:, :-1], atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda: models.get("resnet20").build(num_classes=0), "num_classes must be a positive"),
    (lambda: models.get("lstm").build(hidden_size=6.5), "hidden_size must be a positive"),
    (lambda: models.get("lstm").build(dropout=1.5), "dropout must be a number in"),
    (lambda: models.get("transformer").build(d_model=30, num_heads=4), "divisible by num_heads"),
    (lambda: models.get("resnet50").batch(2, image_size=16), "at least 32"),
    (lambda: models.get("vgg16").batch(2, image_size=40), "multiple of 32"),
    (lambda: models.get("lstm").batch(0), "batch_size must be a positive integer, got 0"),
])
def test_bad_arguments_are_refused_with_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_unknown_build_argument_is_refused():
    with pytest.raises(TypeError, match="hidden"):
        models.get("resnet20").build(hidden_size=10)


def test_transformer_refuses_sequences_longer_than_its_positions():
    model = models.get("transformer").build(vocab_size=20, d_model=16, num_layers=1,
                                            max_seq_len=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_lstm_carries_its_state_across_windows():
    torch.manual_seed(0)
    model = models.lstm.LSTMLanguageModel(vocab_size=30, hidden_size=8, num_layers=2, dropout=0.0).eval()
    tokens = torch.randint(30, (3, 12))
    whole = model(tokens)
    first, state = model(tokens[:, :5], return_state=True)
    second, _ = model(tokens[:, 5:], state, return_state=True)
    assert torch.allclose(torch.cat([first, second], 1), whole, atol=1e-6)
    assert not torch.allclose(model(tokens[:, 5:]), second)  # a zero state differs
