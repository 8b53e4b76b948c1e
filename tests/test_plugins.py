"""Third-party components: the README's decorator example and entry-point discovery."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.compressors import Compressor, Context, register
from tests.distributed import run_ranks


class HalfSign(Compressor):
    """The README's example plugin: sign scaled by half the mean magnitude.

    Registered only inside the rank processes (see the worker), so the suite's loops over
    every registered compressor do not meet it.
    """

    summable = False
    recommended_memory = "residual"

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().reshape(1) / 2
        return (torch.sign(flat).to(torch.int8), scale), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        signs, scale = payload
        return (signs.to(ctx.dtype) * scale.to(ctx.dtype)).view(ctx.shape)


def plugin_training_worker(rank, world_size):
    register("halfsign")(HalfSign)
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         model.named_parameters(), compressor="halfsign")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 5, generator=g)
    y = x @ torch.arange(1.0, 6.0).unsqueeze(1)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], losses[-1], repr(opt.communicator)


def test_registered_plugin_trains_with_its_recommended_memory():
    for first, last, communicator in run_ranks(plugin_training_worker, 2):
        assert last < 0.5 * first
        assert "HalfSign" in communicator and "ResidualMemory" in communicator


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register("topk")(HalfSign)
    with pytest.raises(TypeError, match="subclass"):
        register("notacompressor")(object)


def test_entry_point_plugin_is_discovered(tmp_path):
    package = tmp_path / "mc_plugin_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        from mergecomp.memories import Memory
        class HalfMemory(Memory):
            """Keeps nothing; scales the gradient by one half."""
            def compensate(self, tensor, name):
                return tensor * 0.5
            def update(self, tensor, name, compressor, payload, ctx):
                pass
    '''))
    dist_info = tmp_path / "mc_plugin_pkg-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: mc-plugin-pkg\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[mergecomp.memories]\nhalf = mc_plugin_pkg:HalfMemory\n")
    script = ("import torch, mergecomp; m = mergecomp.memories.create('half'); "
              "print('half' in mergecomp.memories.available(), m.compensate(torch.ones(2), 'g').tolist())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True [0.5, 0.5]"


def test_an_option_a_component_does_not_take_names_the_ones_it_does():
    with pytest.raises(TypeError, match="compressor 'qsgd' takes no option 'level'.*did you mean 'levels'.*levels, bucket_size, seed"):
        mergecomp.compressors.create("qsgd", level=16)
    with pytest.raises(TypeError, match="memory 'residual' takes no option 'momentun'.*did you mean 'momentum'"):
        mergecomp.memories.create("residual", momentun=0.9)
    assert mergecomp.compressors.create("qsgd", levels=16).levels == 16
