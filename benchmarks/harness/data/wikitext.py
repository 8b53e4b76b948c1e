"""WikiText word-level language-modelling data: vocabulary, token streams, BPTT windows.

Merity, Xiong, Bradbury, Socher, "Pointer Sentinel Mixture Models", ICLR 2017.  The
archives (:data:`DOWNLOAD_URLS`) unpack to ``wikitext-2/`` or ``wikitext-103/`` holding
``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``: already tokenised
text, tokens separated by spaces, rare words replaced by ``<unk>``.

As in PyTorch's word_language_model example, every line (empty ones included) is its
whitespace-separated tokens followed by ``<eos>``; the vocabulary is the training file's
tokens; a validation or test token that is not in it reads as ``<unk>``.

For data parallelism each split becomes one stream of ids cut into ``world_size x
batch_size`` equally long rows; rank r trains on rows ``r*batch_size`` to
``(r+1)*batch_size - 1``, so every rank has the same number of BPTT windows, hence the same
steps and collectives.  The last ``len(stream) mod (world_size*batch_size)`` tokens are
dropped.
"""
from __future__ import annotations

import os
from array import array
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Tuple

import numpy as np
import torch
from torch import Tensor

DOWNLOAD_URLS = {
    "wikitext-2": "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip",
    "wikitext-103": "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
}
SPLITS = ("train", "valid", "test")
EOS = "<eos>"
UNK = "<unk>"


def split_file(split: str) -> str:
    return f"wiki.{split}.tokens"


class Vocabulary:
    """Words to ids: ``<unk>`` is 0, ``<eos>`` is 1, then the words in order of first use."""

    def __init__(self, words: Iterable[str] = ()):
        self.words: List[str] = []
        self.ids: Dict[str, int] = {}
        for word in (UNK, EOS, *words):
            self.add(word)

    def add(self, word: str) -> int:
        if word not in self.ids:
            self.ids[word] = len(self.words)
            self.words.append(word)
        return self.ids[word]

    @property
    def unk(self) -> int:
        return self.ids[UNK]

    @property
    def eos(self) -> int:
        return self.ids[EOS]

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, tokens: Iterable[str]) -> Tensor:
        """int64 ids of ``tokens``; unknown tokens become ``<unk>``."""
        unk, ids = self.unk, self.ids
        packed = array("q", (ids.get(token, unk) for token in tokens))  # 8 bytes a token
        return torch.from_numpy(np.frombuffer(packed, dtype=np.int64))


def read_tokens(path: str) -> Iterator[str]:
    """The tokens of a file: each line's whitespace-separated words, then ``<eos>``."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield from line.split()
            yield EOS


@dataclass(frozen=True)
class Corpus:
    """The vocabulary and the three splits as 1-D int64 id streams."""

    vocabulary: Vocabulary
    train: Tensor
    valid: Tensor
    test: Tensor
    folder: str


def find_folder(data_dir: str) -> str:
    """``data_dir`` if it holds the three token files, else its single ``wikitext-2`` or
    ``wikitext-103`` subfolder that does.  FileNotFoundError says what is missing."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"WikiText data directory {data_dir!r} does not exist; download "
                                f"{DOWNLOAD_URLS['wikitext-2']} (or wikitext-103), unzip it and "
                                f"pass the folder holding wiki.train.tokens")
    candidates = [data_dir] + [os.path.join(data_dir, name) for name in DOWNLOAD_URLS]
    complete = [folder for folder in candidates
                if all(os.path.isfile(os.path.join(folder, split_file(s))) for s in SPLITS)]
    if complete and complete[0] == data_dir:
        return data_dir
    if len(complete) == 1:
        return complete[0]
    if len(complete) > 1:
        raise FileNotFoundError(f"{data_dir!r} holds both {complete[0]!r} and {complete[1]!r}: "
                                f"pass the one to train on as the data directory")
    missing = [split_file(s) for s in SPLITS if not os.path.isfile(os.path.join(data_dir, split_file(s)))]
    raise FileNotFoundError(
        f"{data_dir!r} lacks {', '.join(missing)} (and has no wikitext-2/ or wikitext-103/ "
        f"folder holding all three); download {DOWNLOAD_URLS['wikitext-2']} and unzip it")


def load_wikitext(data_dir: str) -> Corpus:
    """Build the vocabulary from the training file and encode the three splits."""
    folder = find_folder(data_dir)
    paths = {split: os.path.join(folder, split_file(split)) for split in SPLITS}
    vocabulary = Vocabulary(read_tokens(paths["train"]))
    streams = {split: vocabulary.encode(read_tokens(path)) for split, path in paths.items()}
    return Corpus(vocabulary, streams["train"], streams["valid"], streams["test"], folder)


def shard_rows(stream: Tensor, batch_size: int, rank: int, world_size: int) -> Tensor:
    """This rank's ``(batch_size, T)`` rows of ``stream`` cut into ``world_size*batch_size``
    rows of equal length T (each row a contiguous stretch of text).

    ValueError when the stream is too short to give every row 2 tokens (one input, one
    target).
    """
    for what, value in (("batch_size", batch_size), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if stream.dim() != 1:
        raise ValueError(f"expected a 1-D id stream, got shape {tuple(stream.shape)}")
    rows = world_size * batch_size
    length = stream.numel() // rows
    if length < 2:
        raise ValueError(f"a stream of {stream.numel()} tokens cannot fill {rows} rows "
                         f"({world_size} ranks x batch size {batch_size}) of at least 2 tokens; "
                         f"use a smaller batch size")
    table = stream[:rows * length].view(rows, length)
    return table[rank * batch_size:(rank + 1) * batch_size]


def bptt_windows(rows: Tensor, bptt: int) -> Iterator[Tuple[Tensor, Tensor]]:
    """``(inputs, targets)`` windows of ``bptt`` steps along the rows, the targets shifted
    by one token; the last window is shorter when ``bptt`` does not divide ``T - 1``."""
    if isinstance(bptt, bool) or not isinstance(bptt, int) or bptt < 1:
        raise ValueError(f"bptt must be a positive integer, got {bptt!r}")
    length = rows.shape[1]
    for start in range(0, length - 1, bptt):
        stop = min(start + bptt, length - 1)
        yield rows[:, start:stop], rows[:, start + 1:stop + 1]


def num_windows(rows: Tensor, bptt: int) -> int:
    """How many windows :func:`bptt_windows` yields."""
    return -(-(rows.shape[1] - 1) // bptt)
