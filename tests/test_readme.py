"""The README and docs/ run as written.

Python blocks run in a fresh namespace that holds only what the text leaves to the user (a
model, a loader, an optimizer), never ``mergecomp`` or ``torch``: a snippet that forgets an
import fails here as it would for a reader.  Blocks that need ranks run on two gloo ranks.
This module imports no ``mergecomp`` submodule either, so the ranks (which import it to run
the workers) see the package as ``import mergecomp`` leaves it.  Shell blocks must call
``.venv/bin/python`` (bare ``python`` or ``torchrun`` fails unless the environment is
activated), and the scripts they name answer ``--help``.
"""
import glob
import os
import re
import subprocess
import sys

import torch
import torch.nn as nn

from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def fenced(path, languages):
    """(heading, code) of every fenced block of ``path`` in one of ``languages``."""
    text = open(path, encoding="utf-8").read()
    found, heading = [], ""
    for match in re.finditer(r"^(#+ [^\n]*)$|^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if match.group(1):
            heading = match.group(1).lstrip("# ")
        elif match.group(2) in languages:
            found.append((heading, match.group(3)))
    return found


def python_block(path, heading):
    (code,) = [code for h, code in fenced(path, {"python"}) if h == heading]
    return code


def parts(code):
    """A block of alternatives (``# DDP: ...``, ``# Lightning: ...``): {name: the block's
    leading lines plus that part}."""
    lines = code.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"# \w+: ", line)]
    head = lines[:starts[0]]
    return {lines[s][2:].split(":")[0]: "\n".join(head + lines[s:e])
            for s, e in zip(starts, starts[1:] + [len(lines)])}


def _user_names(rank):
    torch.manual_seed(rank)  # a different model per rank: the wrapper must make them one
    generator = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(3)]
    return {"build_model": lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
            "loader": data, "epochs": 2, "loss_fn": nn.functional.mse_loss}


def _train(model, optimizer, loader):
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


# ------------------------------------------------------------------------- the README's code

def training_script_worker(rank, world_size, code):
    names = _user_names(rank)
    exec(code, names)
    model, optimizer = names["model"], names["optimizer"]
    return [p.detach().clone() for p in model.parameters()], repr(optimizer.compressor)


def test_the_training_script_snippet_trains_one_model_on_every_rank():
    code = python_block(README, "Use it in your training script")
    (params0, compressor), (params1, _) = run_ranks(training_script_worker, 2, code)
    assert compressor == "TopKCompressor(compress_ratio=0.035, warmup='auto', warmup_steps=0, wire_format='auto')"
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def frameworks_worker(rank, world_size, snippets):
    """The DDP part and the Accelerate part, each in a namespace of its own."""
    results = {}
    names = {"model": _user_names(rank)["build_model"]()}
    exec(snippets["DDP"], names)
    _train(names["ddp"], names["optimizer"], _user_names(rank)["loader"])
    results["DDP"] = (type(names["state"].compressor).__name__, [p.detach().clone() for p in names["ddp"].parameters()])
    model = _user_names(rank)["build_model"]()  # the block builds its Accelerator, as a CPU machine needs
    names = {"model": model, "loader": _user_names(rank)["loader"],
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(snippets["Accelerate"], names)
    _train(names["model"], names["optimizer"], names["loader"])
    results["Accelerate"] = (type(names["state"].compressor).__name__, [p.detach().clone() for p in names["model"].parameters()])
    return results


def test_the_ddp_and_accelerate_snippets_register_the_hook_as_written():
    snippets = parts(python_block(README, "Use it with DDP, Lightning, Accelerate, Horovod"))
    assert set(snippets) == {"DDP", "Lightning", "Accelerate"}
    first, second = run_ranks(frameworks_worker, 2, snippets)
    for part, compressor in (("DDP", "DGCCompressor"), ("Accelerate", "TopKCompressor")):
        assert first[part][0] == second[part][0] == compressor
        assert all(torch.equal(a, b) for a, b in zip(first[part][1], second[part][1])), part


def test_the_lightning_snippet_builds_its_trainer_as_written():
    code = parts(python_block(README, "Use it with DDP, Lightning, Accelerate, Horovod"))["Lightning"]
    names = {}
    exec(code, names)
    assert type(names["trainer"].strategy).__name__ == "MergecompDDPStrategy"


def plugin_worker(rank, world_size, code):
    model = _user_names(rank)["build_model"]()
    names = {"model": model, "base_optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(code, names)
    _train(model, names["opt"], _user_names(rank)["loader"])
    return type(names["opt"].compressor).__name__, [p.detach().clone() for p in model.parameters()]


def test_the_plugin_snippet_trains_with_its_compressor():
    (name, params0), (_, params1) = run_ranks(plugin_worker, 2, python_block(README, "Write a plugin"))
    assert name == "HalfSign" and all(torch.equal(a, b) for a, b in zip(params0, params1))


# ------------------------------------------------------------ the other pages' code, on CPU ranks

class Layers(nn.Module):
    """The reader's model of docs/fsdp.md: its blocks shard ``model.layers``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 3)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _one_step(model, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, _user_names(rank)["loader"][:1])


def docs_worker(rank, world_size, blocks, folder):
    """Each page's block in a namespace of its own holding the reader's names, in ``folder``
    (the blocks write checkpoints and logs where they run)."""
    os.chdir(folder)
    seen = {}
    names = {"model": Layers()}
    exec(blocks["fsdp: Use"], names)
    _one_step(names["model"], rank)
    seen["fsdp"] = names["state"].wire_bytes > 0
    exec(blocks["fsdp: Checkpoints"], dict(names, rank=rank))  # the page's script, continued
    names = {"model": Layers(), "nodes": 2, "ranks_per_node": 1}
    exec(blocks["fsdp: HSDP"], names)
    _one_step(names["model"], rank)
    seen["hsdp"] = names["state"].hsdp
    os.environ["MERGECOMP_LOCAL_SIZE"] = "1"  # what the page says to try HSDP on one machine
    names = {"model": Layers()}
    exec(blocks["fsdp: HSDP node_mesh"], names)
    _one_step(names["model"], rank)
    seen["node_mesh"] = names["state"].hsdp
    names = {"model": Layers()}
    exec(blocks["fsdp: replicate"], names)
    _one_step(names["model"], rank)
    seen["replicate"] = names["state"].replicate and names["state"].wire_bytes > 0
    names = {"model": _user_names(rank)["build_model"]()}
    exec(blocks["hierarchical"], names)
    _one_step(names["model"], rank)
    seen["hierarchical"] = type(names["communicator"]).__name__
    del os.environ["MERGECOMP_LOCAL_SIZE"]
    names = {"model": _user_names(rank)["build_model"]()}
    exec(blocks["sparse-allreduce"], names)
    _train(names["model"], names["optimizer"], _user_names(rank)["loader"])
    seen["sparse"] = type(names["communicator"]).__name__
    exec(blocks["faults: Checkpoints"], dict(names, rank=rank))
    names = {"model": names["model"], "optimizer": names["optimizer"]}
    exec(blocks["step-log"], names)
    seen["files"] = sorted(os.listdir(folder))
    return seen


def test_the_pages_code_runs_as_written_on_cpu_ranks(tmp_path):
    docs = os.path.join(ROOT, "docs")
    fsdp = fenced(os.path.join(docs, "fsdp.md"), {"python"})
    hsdp = [code for heading, code in fsdp if heading.startswith("HSDP")]
    blocks = {"fsdp: Use": python_block(os.path.join(docs, "fsdp.md"), "Use"),
              "fsdp: Checkpoints": python_block(os.path.join(docs, "fsdp.md"), "Checkpoints"),
              "fsdp: HSDP": hsdp[0], "fsdp: HSDP node_mesh": hsdp[1],
              "fsdp: replicate": python_block(os.path.join(docs, "fsdp.md"),
                                              "replicate: the all-reduce of whole gradients"),
              "hierarchical": python_block(os.path.join(docs, "hierarchical.md"), "Use"),
              "sparse-allreduce": fenced(os.path.join(docs, "sparse-allreduce.md"), {"python"})[0][1],
              "faults: Checkpoints": python_block(os.path.join(docs, "faults.md"), "Checkpoints"),
              "step-log": fenced(os.path.join(docs, "step-log.md"), {"python"})[0][1]}
    assert 'init_device_mesh("cuda"' not in hsdp[0]  # a CPU machine has no "cuda" mesh
    for rank, seen in enumerate(run_ranks(docs_worker, 2, blocks, str(tmp_path))):
        assert seen["fsdp"] and seen["hsdp"] and seen["node_mesh"] and seen["replicate"], seen
        assert seen["hierarchical"] == "HierarchicalCommunicator" and seen["sparse"] == "SparseAllreduceCommunicator"
        written = {f"fsdp-compression.rank{rank}.pt", f"ckpt.rank{rank}.pt"} | ({"runs"} if rank == 0 else set())
        assert written <= set(seen["files"]), seen  # rank 0 writes the step log


def diloco_worker(rank, world_size, blocks):
    """Each DiLoCo block of docs/low-communication.md in a namespace of its own: the reader's
    model, loader and loss function."""
    seen = []
    for code in blocks:
        names = _user_names(rank)
        names["model"] = names.pop("build_model")()
        exec(code, names)
        opt = names["opt"]
        if not opt.inner_steps:  # a block that builds its optimizer and leaves the loop to the reader
            _train(names["model"], opt, names["loader"])
        seen.append((type(opt).__name__, type(opt.outer_optimizer).__name__, opt.inner_steps))
    return seen


def test_the_diloco_blocks_run_as_written_on_cpu_ranks():
    blocks = [code for heading, code in fenced(os.path.join(ROOT, "docs", "low-communication.md"), {"python"})
              if heading == "DiLoCo"]
    assert len(blocks) == 3 and "outer_optimizer=lambda" in blocks[1] and "GradScaler" in blocks[2]
    for seen in run_ranks(diloco_worker, 2, blocks):
        assert seen == [("DiLoCo", "SGD", 3)] * 3, seen


# ------------------------------------------------------------------- the conformance kit's page

def test_the_kit_page_runs_and_prints_what_it_says():
    kit = os.path.join(ROOT, "docs", "compressor-kit.md")
    running, checks, reference, compiling, declaring = [code for _, code in fenced(kit, {"python"})]
    # The reader's package: the page's own HalfSign with the ``width`` argument the page passes.
    program = f"""
import sys, types
names = {{}}
exec({declaring!r}, names)
class MySketchCompressor(names["HalfSign"]):
    def __init__(self, width=64):
        self.width = width
sys.modules["my_package"] = types.SimpleNamespace(MySketchCompressor=MySketchCompressor)
exec({running!r}, names)
names["test_my_compressor_keeps_the_contract"]()
exec({checks!r}, dict(MySketchCompressor=MySketchCompressor))
exec("print(check_compressor(HalfSign))", names)
exec({reference!r}, names)
exec({compiling!r}, names)
"""
    # The compiled block runs as written with torch.compile switched off (the opt-in then
    # runs eagerly and says so): compiling itself is tested in test_compiled.py, and a cold
    # inductor compile would cost this test tens of seconds.
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TORCH_COMPILE_DISABLE="1"))
    assert out.returncode == 0, out.stderr
    promised = re.search(r"`print\(check_compressor\(HalfSign\)\)` then says\s+`([^`]*)`",
                         open(kit, encoding="utf-8").read()).group(1)
    assert promised in out.stdout


# ------------------------------------------------------------------ names after `import mergecomp`

def test_every_mergecomp_name_the_docs_use_exists_after_a_plain_import():
    """``mergecomp.a.b`` in a code block must resolve after ``import mergecomp`` alone, in a
    fresh interpreter (a submodule the package does not import is an AttributeError)."""
    dotted = set()
    for path in DOCS:
        for _, code in fenced(path, {"python"}):
            used = re.sub(r"^\s*(from|import) .*$", "", code, flags=re.M)  # imports load what they name
            dotted |= set(re.findall(r"\bmergecomp(?:\.\w+)+", used))
    program = ("import mergecomp, functools\n"
               f"for name in {sorted(dotted)!r}:\n"
               "    functools.reduce(getattr, name.split('.')[1:], mergecomp)\n")
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mergecomp.ddp.bucket_caps" in dotted and "mergecomp.compressors.create" in dotted


# ------------------------------------------------------------------------------ shell commands

def command_texts(path):
    """The shell a reader copies: bash blocks, indented code lines, inline code spans."""
    text = open(path, encoding="utf-8").read()
    blocks = [code for _, code in fenced(path, {"bash", "sh", "shell"})]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    indented = [line for line in prose.splitlines() if line.startswith("    ")]
    spans = re.findall(r"`([^`\n]+)`", prose)
    return blocks + indented + spans


def test_every_command_calls_the_environments_python():
    bare = []
    for path in DOCS:
        for line in (line for text in command_texts(path) for line in text.splitlines()):
            text = re.sub(r"(^|\s)#.*", "", line)  # a shell comment may speak of torchrun
            for match in re.finditer(r"(?<![\w/.-])(python3?|torchrun|pytest)(?= )", text):
                if not re.match(r"\S*\.py\b|-m |-c |-X ", text[match.end() + 1:]) and match.group(1) == "python":
                    continue  # "python version": prose in a code span, not a command
                bare.append(f"{os.path.relpath(path, ROOT)}: {text.strip()[:100]}")
    assert not bare, "call .venv/bin/python (a bare python or torchrun needs an activated environment):\n" + \
        "\n".join(bare)


def test_the_scripts_the_commands_name_answer_help_and_list():
    """Every repository script a shell block runs, with ``--help``, in one interpreter."""
    scripts = set()
    for path in DOCS:
        for text in command_texts(path):
            for script in re.findall(r"\.venv/bin/python (\S+\.py)", text):
                if script != "train.py":  # the reader's own
                    scripts.add(script)
    missing = [s for s in scripts if not os.path.exists(os.path.join(ROOT, s))]
    assert not missing, f"the docs run scripts that do not exist: {missing}"
    program = ("import runpy, sys, contextlib, io\n"
               f"for script, flag in {sorted((s, '--help') for s in scripts) + [('compress_benchmark.py', '--list')]!r}:\n"
               "    sys.argv = [script, flag]\n"
               "    out = io.StringIO()\n"
               "    try:\n"
               "        with contextlib.redirect_stdout(out):\n"
               "            runpy.run_path(script, run_name='__main__')\n"
               "        code = 0\n"
               "    except SystemExit as stop:\n"
               "        code = stop.code or 0\n"
               "    print(script, flag, code, len(out.getvalue()))\n")
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = [line.split() for line in out.stdout.splitlines()]
    assert "compress_benchmark.py" in scripts and len(results) == len(scripts) + 1
    assert all(code == "0" and int(size) > 0 for _, _, code, size in results), out.stdout
