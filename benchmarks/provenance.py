"""Where a benchmark result came from: the command, the commit, torch, the host.

Every result folder's manifest states these (CONTRIBUTING.md); a benchmark that writes
JSON puts :func:`provenance` in it so the numbers carry their origin with them.
"""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Dict, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance(argv=None) -> Dict[str, Any]:
    """The command as typed (relative to the checkout), the commit and whether tracked files
    differed from it, the UTC date, torch, Python, and the host's processor count and
    architecture (never its name or paths)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and os.path.isabs(argv[0]):
        argv[0] = os.path.relpath(argv[0], ROOT)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"command": "python " + " ".join(shlex.quote(a) for a in argv),
            "commit": _git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": None if status is None else bool(status),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "python": platform.python_version(),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                     "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}}
