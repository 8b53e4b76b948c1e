#!/usr/bin/env python
"""Carry iproute2 (``ip``, ``tc``) to a Linux host that has none and no network to install it.

The emulated cluster (:mod:`benchmarks.harness.cluster`) shapes its links with ``ip`` and
``tc``.  A GPU machine lent for a few minutes may have root, network namespaces and the
kernel's qdiscs, but no iproute2 and no package mirror.  This copies the two programs from
a host that has them, with every shared library they load (the C library and its loader
included, so they run whatever the other host's libraries are), into one folder:

    python benchmarks/harness/iproute2_bundle.py build/iproute2     # here, where iproute2 is

    DIR/lib/       the programs' libraries and the dynamic loader
    DIR/libexec/   the ip and tc binaries
    DIR/bin/       ip and tc: shell wrappers that start each binary with the bundled loader
                   (``ld.so --library-path DIR/lib``), so nothing leaks into the programs
                   ``ip netns exec`` starts

The cluster finds ``DIR/bin`` by itself (``build/iproute2`` in the repository, or the folder
in ``MERGECOMP_IPROUTE2``) when ``ip`` or ``tc`` is not on the PATH.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

PROGRAMS = ("ip", "tc")

#: Where a carried iproute2 is looked for when ``MERGECOMP_IPROUTE2`` names none.
DEFAULT_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "build", "iproute2")

#: ``ldd`` lines: "libx.so.1 => /path/libx.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)".
_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")

WRAPPER = """#!/bin/sh
# {program} from iproute2, run with its bundled libraries (benchmarks/harness/iproute2_bundle.py)
here="${{0%/*}}/.."
exec "$here/lib/{loader}" --library-path "$here/lib" "$here/libexec/{program}" "$@"
"""


def libraries(binary: str) -> List[str]:
    """The absolute paths ``ldd`` resolves for ``binary`` (its loader included)."""
    listed = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    paths = []
    for line in listed.splitlines():
        match = _LDD_LINE.match(line)
        if match:
            paths.append(match.group(1))
        elif "not found" in line:
            raise RuntimeError(f"{binary} needs a library this host lacks: {line.strip()}")
    return paths


def bundle(folder: str) -> Dict[str, str]:
    """Copy ``ip`` and ``tc`` and their libraries into ``folder``; return program → wrapper."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"iproute2 bundles are for Linux hosts, this is {sys.platform}")
    found = {program: shutil.which(program) for program in PROGRAMS}
    missing = [program for program, path in found.items() if path is None]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found on this host's PATH: bundle from a host with "
                           f"iproute2 (apt-get install iproute2)")
    for sub in ("bin", "lib", "libexec"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    loaders = set()
    for program, path in found.items():
        real = os.path.realpath(path)
        shutil.copy2(real, os.path.join(folder, "libexec", program))
        for library in libraries(real):
            name = os.path.basename(library)
            shutil.copy2(os.path.realpath(library), os.path.join(folder, "lib", name))
            if name.startswith("ld-linux") or name.startswith("ld64"):
                loaders.add(name)
    if len(loaders) != 1:
        raise RuntimeError(f"expected one dynamic loader among the programs' libraries, found {sorted(loaders)}")
    loader = loaders.pop()
    wrappers = {}
    for program in PROGRAMS:
        wrapper = os.path.join(folder, "bin", program)
        with open(wrapper, "w") as f:
            f.write(WRAPPER.format(program=program, loader=loader))
        os.chmod(wrapper, 0o755)
        wrappers[program] = wrapper
    return wrappers


def put_on_path() -> Optional[str]:
    """Put a carried iproute2's ``bin`` first on this process's PATH (``MERGECOMP_IPROUTE2``,
    else ``build/iproute2`` in the repository) when it holds both programs, so that they and
    every child find them; the folder, or None when there is no bundle."""
    folder = os.path.join(os.environ.get("MERGECOMP_IPROUTE2") or DEFAULT_FOLDER, "bin")
    if not all(os.access(os.path.join(folder, program), os.X_OK) for program in PROGRAMS):
        return None
    os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
    return folder


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: iproute2_bundle.py FOLDER", file=sys.stderr)
        return 2
    wrappers = bundle(args[0])
    for program, wrapper in wrappers.items():
        version = subprocess.run([wrapper, "-V"], capture_output=True, text=True)
        print(f"{program}: {wrapper} ({(version.stdout or version.stderr).strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
