"""How a benchmark runs: its modes, its exit, its ranks (here or spawned), and the backend
that builds components before any rank exists."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional

from mergecomp.distributed import launch
from mergecomp.distributed.backends.base import Backend


def run_mode(prog: str, doc: str, modes: Dict[str, Callable[[List[str]], int]], argv=None,
             default: Optional[str] = None) -> int:
    """``prog MODE [flags]``: a tool that answers one question several ways takes the way as
    its first word and hands the rest of ``argv`` to ``modes[MODE]``.  With ``default``, flags
    alone (``--help`` included) go to that mode, so the tool's plain form keeps working."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in modes:
        return modes[argv[0]](argv[1:])
    if default is not None and (not argv or argv[0].startswith("-")):
        return modes[default](argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {prog} {{{','.join(modes)}}} ...\n\n{doc.strip()}")
        return 0
    given = f"unknown mode {argv[0]!r}" if argv else "no mode given"
    print(f"usage: {prog} {{{','.join(modes)}}} ...\n{prog}: error: {given}: the first word is one of "
          f"{', '.join(modes)} (then '{prog} MODE --help' for its flags)", file=sys.stderr)
    raise SystemExit(2)


def exit_with(main: Callable[[], int]) -> None:
    """Run a benchmark script's ``main()`` and exit with its code; a ValueError (an unknown
    name, a value out of range, a clash of flags) is printed as one line,
    ``script.py: error: ...`` as argparse prints its errors, and exits 2, without a
    traceback.

    A rank started by a launcher (torchrun, mpirun) exits without the interpreter's
    teardown once ``main()`` returned (see :func:`launch.exit_without_teardown`).
    """
    try:
        code = main()
    except ValueError as error:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)
    if launch.detect().launcher not in ("single", "spawn"):
        launch.exit_without_teardown(code or 0)
    sys.exit(code)


def run_workers(worker: Callable[[Any], Any], args) -> None:
    """Run ``worker(args)`` here when a launcher started us, or spawn ``args.nproc`` local ranks.

    Check the flags before (:class:`NoProcessGroup` builds what needs no ranks); a
    ValueError a spawned rank still raises (bad input only a rank can see) comes back as a
    ValueError naming the rank, without the rank's traceback; any other failure keeps it.
    """
    launcher = launch.detect().launcher
    if args.nproc is not None and launcher not in ("single", "spawn"):
        raise SystemExit(f"--nproc {args.nproc} was given but this process was started by "
                         f"{launcher}; use one or the other")
    if args.nproc is not None and launcher == "single":
        try:
            launch.spawn(worker, args.nproc, args=(args,))
        except launch.SpawnedProcessError as failure:
            message = value_error_message(failure.child_traceback)
            if message is None:
                raise
            raise ValueError(f"rank {failure.rank}: {message}") from None
    else:
        worker(args)


def value_error_message(formatted: Optional[str]) -> Optional[str]:
    """The message of the exception ``formatted`` (a ``traceback.format_exc()`` text) ends
    with, if that exception is a ValueError; None otherwise (or for no traceback)."""
    if not formatted:
        return None
    lines = formatted.rstrip("\n").split("\n")
    # The last exception's text starts at the first unindented line after its last frame.
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
    start = next((i for i in range(last_frame + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), None)
    if start is None or not lines[start].startswith("ValueError: "):
        return None
    return "\n".join(lines[start:])[len("ValueError: "):]


class NoProcessGroup(Backend):
    """A backend with no process group behind it, for building components before any rank
    exists.

    The launching process builds the communicator the ranks will build with it, so the
    checks communicators make at construction (allreduce refusing a compressor whose
    payloads do not add up, ...) fail before processes are spawned, in one line, instead
    of in every rank.  It is rank 0 of ``size``; every collective raises.
    """

    name = "no-process-group"

    def __init__(self, size: int = 1):
        super().__init__()
        self._size = size

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return self._size

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("NoProcessGroup has no process group: it builds components for their "
                           "checks, it cannot run collectives")

    allreduce_async = allgather_async = alltoall = _refuse
    broadcast_object = allgather_object = barrier = _refuse
