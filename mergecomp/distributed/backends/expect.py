"""What a value a peer sends as JSON must look like, checked before this rank uses it.

Values between ranks travel as JSON (:meth:`Backend.allgather_object`,
:meth:`Backend.broadcast_object`).  A rank that runs another mergecomp version, a collective
that got out of step, or damaged bytes can hand this rank any JSON at all: a list where a
dict belongs, a string where a number does, a list one item short.  Used unchecked, such a
value fails far from its cause (a ``TypeError`` inside ``max``, an unpacking error) or is cut
short without a word by a ``zip``.  So the call that receives it says what it expects, and a
value of another form is refused as a bad header naming the rank that sent it::

    everyone = backend.allgather_object(facts, expect=OBJECT)
    pairs = backend.broadcast_object(pairs, src=0, expect=list_of(tuple_of(INT, NUMBER)))

The checks recurse only as deep as the value nests, which the backend bounds
(``JSON_MAX_DEPTH``) before any of them runs.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch


class Expect:
    """A form of JSON value: ``what`` it is in words, and ``problem(value)``, which says
    where and how ``value`` differs from it (None: it has the form)."""

    def __init__(self, what: str, check: Callable[[Any, str], Optional[str]]):
        self.what = what
        self._check = check

    def problem(self, value: Any, where: str = "the value") -> Optional[str]:
        return self._check(value, where)

    def __repr__(self) -> str:
        return f"Expect({self.what!r})"


def shown(value: Any, width: int = 60) -> str:
    """A short JSON rendering of ``value`` for a message."""
    text = json.dumps(value)
    return text if len(text) <= width else text[:width] + "…"


def _simple(what: str, test: Callable[[Any], bool]) -> Expect:
    return Expect(what, lambda value, where: None if test(value) else f"{where} is {shown(value)}, not {what}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


ANY = Expect("any JSON value", lambda value, where: None)
NUMBER = _simple("a number", _is_number)
INT = _simple("a whole number", lambda value: isinstance(value, int) and not isinstance(value, bool))
STRING = _simple("a string", lambda value: isinstance(value, str))
OBJECT = _simple("a JSON object", lambda value: isinstance(value, dict))
NONE = _simple("None", lambda value: value is None)
#: The name of a torch dtype (``"float32"``), as ``str(dtype)`` gives it without ``torch.``.
DTYPE_NAME = _simple("the name of a torch dtype",
                     lambda value: isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype))


def optional(expected: Expect) -> Expect:
    """None, or a value of the form ``expected``."""
    return one_of(NONE, expected)


def one_of(*choices: Expect) -> Expect:
    """A value of any of the forms ``choices``."""
    what = " or ".join(choice.what for choice in choices)

    def check(value, where):
        if any(choice.problem(value, where) is None for choice in choices):
            return None
        return f"{where} is {shown(value)}, not {what}"
    return Expect(what, check)


def list_of(item: Expect, length: Optional[int] = None) -> Expect:
    """A list (a tuple sent) of items of the form ``item``; of ``length`` items if given."""
    what = f"a list of {'' if length is None else f'{length} '}{item.what}"

    def check(value, where):
        if not isinstance(value, list):
            return f"{where} is {shown(value)}, not {what}"
        if length is not None and len(value) != length:
            return f"{where} has {len(value)} items, not {length}"
        for index, entry in enumerate(value):
            problem = item.problem(entry, f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    return Expect(what, check)


def tuple_of(*items: Expect) -> Expect:
    """A list (a tuple sent) of exactly these items, in this order."""
    what = "[" + ", ".join(item.what for item in items) + "]"

    def check(value, where):
        if not isinstance(value, list) or len(value) != len(items):
            return f"{where} is {shown(value)}, not {what}"
        for index, (entry, item) in enumerate(zip(value, items)):
            problem = item.problem(entry, f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    return Expect(what, check)


def object_of(item: Expect) -> Expect:
    """A JSON object whose every value has the form ``item``."""
    what = f"a JSON object of {item.what}"

    def check(value, where):
        if not isinstance(value, dict):
            return f"{where} is {shown(value)}, not {what}"
        for key, entry in value.items():
            problem = item.problem(entry, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    return Expect(what, check)


def fields(**items: Expect) -> Expect:
    """A JSON object with (at least) these keys, each value of its form."""
    what = "a JSON object with " + ", ".join(f"{key!r}: {item.what}" for key, item in items.items())

    def check(value, where):
        if not isinstance(value, dict):
            return f"{where} is {shown(value)}, not {what}"
        for key, item in items.items():
            if key not in value:
                return f"{where} has no {key!r}"
            problem = item.problem(value[key], f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    return Expect(what, check)


def index_below(count: int) -> Expect:
    """A whole number from 0 to ``count`` − 1: an index into a list of ``count``."""
    what = f"a whole number from 0 to {count - 1}"
    return _simple(what, lambda value: isinstance(value, int) and not isinstance(value, bool)
                   and 0 <= value < count)
