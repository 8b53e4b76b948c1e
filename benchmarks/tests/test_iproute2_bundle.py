"""The carried iproute2: ip and tc with their own libraries and loader, found by the cluster."""
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.harness import cluster, iproute2_bundle

needs_iproute2 = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not (shutil.which("ip") and shutil.which("tc")),
    reason="bundling copies this host's iproute2 (ip, tc), which it does not have")


@needs_iproute2
def test_the_bundle_runs_ip_and_tc_on_its_own_libraries(tmp_path):
    wrappers = iproute2_bundle.bundle(str(tmp_path / "iproute2"))
    assert sorted(wrappers) == ["ip", "tc"]
    libraries = os.listdir(tmp_path / "iproute2" / "lib")
    assert "libc.so.6" in libraries and any(name.startswith("ld-") for name in libraries)
    for program, wrapper in wrappers.items():
        # nothing but the wrapper's own folder on the PATH: no dirname, no system ip
        done = subprocess.run([wrapper, "-V"], capture_output=True, text=True, env={"PATH": "/nonexistent"})
        assert done.returncode == 0 and "iproute2" in done.stdout + done.stderr, (program, done)


@needs_iproute2
def test_the_cluster_puts_a_carried_bundle_on_the_path(tmp_path, monkeypatch):
    iproute2_bundle.bundle(str(tmp_path / "carried"))
    monkeypatch.setenv("MERGECOMP_IPROUTE2", str(tmp_path / "carried"))
    monkeypatch.setenv("PATH", "/nonexistent")
    cluster._ensure_iproute2()
    assert shutil.which("ip") == str(tmp_path / "carried" / "bin" / "ip")


def test_no_bundle_leaves_the_path_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGECOMP_IPROUTE2", str(tmp_path / "absent"))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert iproute2_bundle.put_on_path() is None and os.environ["PATH"] == "/nonexistent"


def test_the_bundler_needs_a_folder(capsys):
    assert iproute2_bundle.main([]) == 2 and "usage" in capsys.readouterr().err
