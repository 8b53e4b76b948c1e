"""Dataset readers: CIFAR-10 batches (layout, errors, refused pickles, augmentation,
normalisation) and WikiText (vocabulary, <unk>/<eos>, shards, BPTT windows)."""
import os
import pickle

import numpy as np
import pytest
import torch

from benchmarks.harness.data import cifar, text, wikitext
from benchmarks.tests.dataset_files import LABEL_NAMES, WIKI_WORDS, dump_like_the_originals, write_cifar, write_wikitext


# ----------------------------------------------------------------------------- CIFAR-10

def test_cifar_batch_is_read_as_rgb_planes(tmp_path):
    written = write_cifar(tmp_path / "cifar-10-batches-py")
    split = cifar.read_batch(str(tmp_path / "cifar-10-batches-py" / "data_batch_2"))
    data, labels = written["data_batch_2"]
    assert split.images.dtype == torch.uint8 and split.images.shape == (32, 3, 32, 32)
    assert split.labels.dtype == torch.int64 and split.labels.tolist() == labels
    for image, channel, y, x in [(0, 0, 0, 0), (5, 1, 3, 7), (31, 2, 31, 31), (9, 2, 30, 1)]:
        assert split.images[image, channel, y, x] == data[image, channel * 1024 + y * 32 + x]


@pytest.mark.parametrize("inside", [True, False])
def test_cifar_loader_finds_the_folder_and_joins_the_batches(tmp_path, inside):
    folder = tmp_path / "cifar-10-batches-py" if inside else tmp_path
    written = write_cifar(folder)
    data = cifar.load_cifar10(str(tmp_path))
    assert data.folder == str(folder)
    assert data.train_files == ("data_batch_1", "data_batch_2")
    assert data.label_names == tuple(LABEL_NAMES)
    assert len(data.train) == 64 and len(data.test) == 16
    first, second = written["data_batch_1"][0], written["data_batch_2"][0]
    assert torch.equal(data.train.images.reshape(64, -1),
                       torch.from_numpy(np.concatenate([first, second])))
    assert data.test.labels.tolist() == written["test_batch"][1]


def test_cifar_loader_explains_what_is_missing_or_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*cifar-10-python.tar.gz"):
        cifar.load_cifar10(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 batches.*data_batch_1"):
        cifar.load_cifar10(str(tmp_path))
    write_cifar(tmp_path, train_sizes=(4, 4, 4))
    os.remove(tmp_path / "data_batch_2")
    with pytest.raises(FileNotFoundError, match=r"data_batch_2 is missing but \['data_batch_3'\]"):
        cifar.load_cifar10(str(tmp_path))
    os.remove(tmp_path / "data_batch_3")
    os.remove(tmp_path / "test_batch")
    with pytest.raises(FileNotFoundError, match="test_batch is missing"):
        cifar.load_cifar10(str(tmp_path))
    bad = tmp_path / "bad"
    dump_like_the_originals(bad, {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    with pytest.raises(ValueError, match=r"N x 3072 uint8 array.*shape \(2, 100\)"):
        cifar.read_batch(str(bad))
    dump_like_the_originals(bad, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]})
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\), found \[0, 10\]"):
        cifar.read_batch(str(bad))
    dump_like_the_originals(bad, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]})
    with pytest.raises(ValueError, match="2 images but labels of shape"):
        cifar.read_batch(str(bad))


def test_cifar_loader_refuses_pickles_that_run_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "data_batch_1"
    with open(path, "wb") as f:
        pickle.dump({b"data": Payload(), b"labels": []}, f, protocol=2)
    with pytest.raises(ValueError, match=r"refusing (posix|os|nt)\.system"):
        cifar.read_batch(str(path))


def test_cifar_loader_reads_batches_re_pickled_by_numpy_2(tmp_path):
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    for protocol in (2, 4, 5):
        path = tmp_path / f"batch{protocol}"
        with open(path, "wb") as f:
            pickle.dump({"data": data, "labels": [3, 4]}, f, protocol=protocol)
        split = cifar.read_batch(str(path))
        assert split.labels.tolist() == [3, 4]
        assert torch.equal(split.images.reshape(2, -1), torch.from_numpy(data))


def test_channel_statistics_and_normalisation():
    images = torch.randint(0, 256, (50, 3, 8, 8), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    images[:, 1] //= 2  # a darker green channel
    mean, std = cifar.channel_statistics(images, chunk=7)
    as_float = images.double().div(255).transpose(0, 1).reshape(3, -1)
    assert torch.allclose(mean.double(), as_float.mean(1), atol=1e-6)
    assert torch.allclose(std.double(), as_float.std(1, unbiased=False), atol=1e-6)
    normalised = cifar.normalize(images, mean, std)
    assert normalised.dtype == torch.float32 and normalised.shape == images.shape
    per_channel = normalised.transpose(0, 1).reshape(3, -1)
    assert torch.allclose(per_channel.mean(1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(per_channel.std(1, unbiased=False), torch.ones(3), atol=1e-5)
    with pytest.raises(ValueError, match="constant"):
        cifar.channel_statistics(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))


def test_random_crop_flip_takes_a_window_of_the_padded_image():
    images = torch.randint(1, 256, (64, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    out = cifar.random_crop_flip(images, torch.Generator().manual_seed(2))
    again = cifar.random_crop_flip(images, torch.Generator().manual_seed(2))
    assert out.dtype == torch.uint8 and out.shape == images.shape and torch.equal(out, again)
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    flipped = shifted = 0
    for i in range(64):
        matches = [(top, left, flip) for top in range(9) for left in range(9) for flip in (0, 1)
                   if torch.equal(out[i], (lambda w: w.flip(2) if flip else w)(
                       padded[i, :, top:top + 32, left:left + 32]))]
        assert matches, f"image {i} is not a (mirrored) window of the padded image"
        flipped += matches[0][2]
        shifted += matches[0][:2] != (4, 4)
    assert 16 < flipped < 48 and shifted > 48  # about half mirrored, most moved
    unpadded = cifar.random_crop_flip(images, torch.Generator().manual_seed(3), padding=0)
    assert all(torch.equal(u, i) or torch.equal(u, i.flip(2)) for u, i in zip(unpadded, images))


# ----------------------------------------------------------------------------- WikiText

def test_vocabulary_eos_unk_and_first_use_order(tmp_path):
    (tmp_path / "wiki.train.tokens").write_text(" = Title = \n\n the cat <unk> sat \n")
    vocabulary = wikitext.Vocabulary(wikitext.read_tokens(str(tmp_path / "wiki.train.tokens")))
    assert vocabulary.words == ["<unk>", "<eos>", "=", "Title", "the", "cat", "sat"]
    assert (vocabulary.unk, vocabulary.eos, len(vocabulary)) == (0, 1, 7)
    (tmp_path / "other").write_text("the dog sat\n\n")
    ids = vocabulary.encode(wikitext.read_tokens(str(tmp_path / "other")))
    assert ids.dtype == torch.int64
    assert ids.tolist() == [4, 0, 6, 1, 1]  # dog is unknown; the blank line is one <eos>


def test_wikitext_corpus_and_its_folder(tmp_path):
    write_wikitext(tmp_path / "wikitext-2")
    corpus = wikitext.load_wikitext(str(tmp_path))
    assert corpus.folder == str(tmp_path / "wikitext-2")
    words = set(WIKI_WORDS) | {"<unk>", "<eos>", "=", "Section"}
    assert set(corpus.vocabulary.words) == words
    lines = (tmp_path / "wikitext-2" / "wiki.valid.tokens").read_text().splitlines()
    assert corpus.valid.numel() == sum(len(line.split()) + 1 for line in lines)
    assert (corpus.valid == corpus.vocabulary.unk).sum() == sum(line.split().count("zebra") for line in lines)
    assert int((corpus.train == corpus.vocabulary.eos).sum()) == len(
        (tmp_path / "wikitext-2" / "wiki.train.tokens").read_text().splitlines())
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="lacks wiki.train.tokens.*wikitext-2-v1.zip"):
        wikitext.load_wikitext(str(tmp_path / "empty"))
    write_wikitext(tmp_path / "wikitext-103")
    with pytest.raises(FileNotFoundError, match="holds both"):
        wikitext.find_folder(str(tmp_path))


def test_rows_are_disjoint_contiguous_shards_and_windows_shift_by_one():
    stream = torch.arange(103)
    shards = [wikitext.shard_rows(stream, 2, rank, 3) for rank in range(3)]
    assert all(s.shape == (2, 17) for s in shards)  # 103 // 6 = 17 tokens a row
    assert torch.equal(torch.cat(shards).reshape(-1), stream[:102])
    windows = list(wikitext.bptt_windows(shards[1], 5))
    assert len(windows) == wikitext.num_windows(shards[1], 5) == 4  # 16 targets: 5+5+5+1
    assert [w[0].shape[1] for w in windows] == [5, 5, 5, 1]
    for inputs, targets in windows:
        assert torch.equal(targets, inputs + 1)
    assert torch.equal(torch.cat([w[0] for w in windows], 1), shards[1][:, :-1])
    with pytest.raises(ValueError, match="cannot fill 8 rows.*smaller batch size"):
        wikitext.shard_rows(torch.arange(15), 4, 0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        wikitext.shard_rows(stream, 2, 3, 3)


# ----------------------------------------------------------------------------- text corpora

def test_python_docs_corpus_is_english_split_in_order():
    corpus = text.load_text("pydoc", "char")
    assert corpus.level == "char" and corpus.symbols[0] == text.UNKNOWN_CHAR
    assert corpus.train.numel() > 100_000 and corpus.valid.numel() > 10_000
    decoded = "".join(corpus.symbols[i] for i in corpus.train[:2000].tolist())
    assert " the " in decoded  # English prose, in the order of the topics' names
    again = text.load_text("pydoc", "char")
    assert torch.equal(corpus.valid, again.valid)


def test_python_library_corpus_reads_docstrings_in_path_order_without_importing(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "python_docs_text", lambda: "TOPICS")
    long = "x" * text.MIN_DOCSTRING_CHARS
    (tmp_path / "b.py").write_text(f'"""module b {long}"""\ndef f():\n    """function f {long}"""\n'
                                   f'    raise SystemExit("never imported")\n', encoding="utf-8")
    (tmp_path / "a.py").write_text(f'class A:\n    """class A {long}"""\n    def g(self):\n'
                                   f'        """short"""\n', encoding="utf-8")
    (tmp_path / "broken.py").write_text("def (:\n", encoding="utf-8")
    for skipped in ("test", "site-packages", "idlelib"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "c.py").write_text(f'"""{skipped} {long}"""\n', encoding="utf-8")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "d.py").write_text(f'"""package d {long}"""\n', encoding="utf-8")
    found = text.python_library_text(str(tmp_path)).split("\n\n")
    assert [part.split(" x")[0] for part in found] == ["TOPICS", "class A", "module b", "function f", "package d"]
    with pytest.raises(FileNotFoundError, match="'pydoc', a text file"):
        text.python_library_text(str(tmp_path / "missing"))


def test_python_corpus_is_the_library_text_split_and_named(monkeypatch):
    monkeypatch.setattr(text, "python_library_text", lambda: "The library's English. " * 200)
    corpus = text.load_text("python")
    assert corpus.train.numel() + corpus.valid.numel() + corpus.test.numel() == 23 * 200
    assert "standard-library docstrings" in corpus.describe()


def test_wikitext_folder_read_as_characters_and_words(tmp_path):
    write_wikitext(tmp_path / "wikitext-2")
    chars = text.load_text(str(tmp_path), "char")
    raw = {split: (tmp_path / "wikitext-2" / f"wiki.{split}.tokens").read_text() for split in ("train", "valid")}
    assert chars.source == "wikitext-2"
    assert chars.train.numel() == len(raw["train"]) and chars.valid.numel() == len(raw["valid"])
    assert "".join(chars.symbols[i] for i in chars.train.tolist()) == raw["train"]
    assert set(chars.symbols) == {text.UNKNOWN_CHAR} | set(raw["train"])
    words = text.load_text(str(tmp_path), "word")
    reference = wikitext.load_wikitext(str(tmp_path))
    assert words.symbols == tuple(reference.vocabulary.words)
    assert torch.equal(words.valid, reference.valid) and torch.equal(words.train, reference.train)


def test_text_file_split_and_what_is_refused(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("abcdefghij" * 20)
    corpus = text.load_text(str(path), "char", valid_fraction=0.2, test_fraction=0.1)
    assert (corpus.train.numel(), corpus.valid.numel(), corpus.test.numel()) == (140, 40, 20)
    assert corpus.vocab_size == 11
    with pytest.raises(FileNotFoundError, match="neither 'pydoc', 'python', 'kjv' nor an existing file"):
        text.load_text(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="level must be one of"):
        text.load_text(str(path), "byte")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        text.load_text(str(tmp_path / "empty.txt"))
    rows = text.validation_rows(corpus.valid, 3, 16)
    assert rows.shape == (2, 16) and torch.equal(rows.reshape(-1), corpus.valid[:32])
