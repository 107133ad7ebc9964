"""Tests for reading, splitting and preparing the Penn Treebank (section 6.3: WSJ sections
02-21 for training, 22 for development, 23 for test; NLTK's sample split by file)."""

from __future__ import annotations

import collections
import gzip
import json
import zipfile
from pathlib import Path

import pytest

from aiayn.files import InputError, UsageError, sha256_file
from aiayn.parsing.linearize import delinearize, linearize, punctuation_tags
from aiayn.parsing.ptb import (
    MANIFEST_FILE,
    OUTPUT_FILES,
    detect_split,
    prepare_treebank,
    read_silver,
    read_treebank,
    split_of,
    tree_file_to_pairs,
)
from aiayn.parsing.trees import Tree, clean, parse_tree, read_tree_lines
from helpers import ROOT

SAMPLE = ROOT.parent / "shared" / "data" / "ptb-sample" / "treebank.zip"
needs_sample = pytest.mark.skipif(not SAMPLE.is_file(), reason=f"needs {SAMPLE}")

#: wsj_0001's first tree as the PTB writes it, and cleaned, both copied by hand.
WSJ_0001_1 = """( (S
    (NP-SBJ
      (NP (NNP Pierre) (NNP Vinken) )
      (, ,)
      (ADJP
        (NP (CD 61) (NNS years) )
        (JJ old) )
      (, ,) )
    (VP (MD will)
      (VP (VB join)
        (NP (DT the) (NN board) )
        (PP-CLR (IN as)
          (NP (DT a) (JJ nonexecutive) (NN director) ))
        (NP-TMP (NNP Nov.) (CD 29) )))
    (. .) ))"""
WSJ_0001_1_CLEAN = (
    "(S (NP (NP (NNP Pierre) (NNP Vinken)) (, ,) (ADJP (NP (CD 61) (NNS years)) (JJ old)) (, ,))"
    " (VP (MD will) (VP (VB join) (NP (DT the) (NN board)) (PP (IN as) (NP (DT a) (JJ nonexecutive)"
    " (NN director))) (NP (NNP Nov.) (CD 29)))) (. .))"
)
TRACE = "( (S (NP-SBJ-1 (-NONE- *)) (VP (VBD ran) (ADVP-TMP (RB today))) (. .)) )\n"
EMPTY = "( (S (NP-SBJ (-NONE- *)) (VP (-NONE- *?*))) )\n"


def tree_text(word: str) -> str:
    return f"( (S (NP-SBJ (DT the) (NN {word}))\n    (VP (VBD sat)) (. .)) )\n"


def mini_files(ids: list[str]) -> dict[str, str]:
    """file id -> .mrg text: two trees each, the first with a trace (all words kept)."""
    return {file_id: TRACE + tree_text(file_id) for file_id in ids}


def write_zip(
    path: Path, files: dict[str, str | bytes], prefix: str = "treebank/combined/"
) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{prefix}README", "not a tree file\n")
        for file_id, text in files.items():
            z.writestr(f"{prefix}{file_id}.mrg", text)
    return path


def write_ldc(root: Path, files: dict[str, str]) -> Path:
    for file_id, text in files.items():
        d = root / "wsj" / file_id[4:6]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{file_id}.mrg").write_text(text)
    return root


SAMPLE_IDS = ["wsj_0001", "wsj_0159", "wsj_0160", "wsj_0180", "wsj_0199"]
LDC_IDS = ["wsj_0001", "wsj_0201", "wsj_2199", "wsj_2201", "wsj_2301", "wsj_2401"]


# --------------------------------------------------------------------------- reading
def test_read_zip_and_directory_alike(tmp_path: Path) -> None:
    """The NLTK zip and the same files unpacked read the same, by file id."""
    files = mini_files(["wsj_0002", "wsj_0001"])
    zipped = list(read_treebank(write_zip(tmp_path / "tb.zip", dict(files))))
    with zipfile.ZipFile(tmp_path / "tb.zip") as z:
        z.extractall(tmp_path / "unpacked")
    for source in (tmp_path / "unpacked", tmp_path / "unpacked" / "treebank" / "combined"):
        assert list(read_treebank(source)) == zipped
    assert [(f, line) for f, line, _ in zipped] == [("wsj_0001", 1), ("wsj_0001", 2)] + [
        ("wsj_0002", 1),
        ("wsj_0002", 2),
    ]
    assert zipped[1][2] == parse_tree(tree_text("wsj_0001"))  # as read: not cleaned


def test_read_ldc_layout(tmp_path: Path) -> None:
    write_ldc(tmp_path / "LDC99T42" / "treebank_3" / "parsed" / "mrg", mini_files(LDC_IDS))
    for source in (tmp_path, tmp_path / "LDC99T42" / "treebank_3" / "parsed" / "mrg" / "wsj"):
        ids = sorted({f for f, _, _ in read_treebank(source)})
        assert ids == LDC_IDS


@pytest.mark.parametrize(
    "member, content, line, problem",
    [
        ("wsj_0002", TRACE + "( (S (NP (DT a)\n  (NN b)\n", 2, "unbalanced bracket"),
        ("wsj_0002", TRACE.replace("\n", "\r\n") + "garbage\r\n", 2, "text outside a tree"),
        ("wsj_0001", b"( (S (NN caf\xe9)) )\n", 1, "invalid UTF-8"),
        ("wsj_0002", TRACE + "( (S (NP the cat)) )\n", 2, "a word outside a pre-terminal"),
    ],
)
def test_errors_name_the_zip_member_and_line(
    tmp_path: Path, member: str, content: str | bytes, line: int, problem: str
) -> None:
    files: dict[str, str | bytes] = dict(mini_files(["wsj_0001", "wsj_0002"]))
    files[member] = content
    source = write_zip(tmp_path / "tb.zip", files)
    with pytest.raises(InputError) as e:
        list(read_treebank(source))
    where = f"{source}/treebank/combined/{member}.mrg:{line}"
    assert str(e.value).startswith(where) and problem in str(e.value), e.value


def test_errors_name_the_file_in_a_directory(tmp_path: Path) -> None:
    write_ldc(tmp_path, {"wsj_0201": TRACE + TRACE + "( (S (NP (DT a))\n"})
    with pytest.raises(InputError, match=r"wsj/02/wsj_0201\.mrg:3: unbalanced"):
        list(read_treebank(tmp_path))


def test_sources_without_a_treebank(tmp_path: Path) -> None:
    """A zip without the members, a file that is not a zip, a missing path, empty files,
    and the same file twice are errors naming the path."""
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("corpus/a.txt", "hello\n")
    not_zip = tmp_path / "trees.txt"
    not_zip.write_text(TRACE)
    empty = write_zip(tmp_path / "empty.zip", {"wsj_0001": "", "wsj_0002": "\n\n"})
    (tmp_path / "dir").mkdir()
    cases = [
        (other, "no treebank files in it"),
        (not_zip, "not a zip archive"),
        (tmp_path / "missing", "no such file or directory"),
        (tmp_path / "dir", "no treebank files in it"),
        (empty, "no trees found in its 2 treebank files"),
    ]
    for source, problem in cases:
        with pytest.raises(InputError, match=rf"^{source}: {problem}"):
            list(read_treebank(source))
    write_ldc(tmp_path / "twice" / "a", mini_files(["wsj_0201"]))
    write_ldc(tmp_path / "twice" / "b", mini_files(["wsj_0201"]))
    with pytest.raises(InputError, match="wsj_0201 found twice"):
        list(read_treebank(tmp_path / "twice"))


def test_splits() -> None:
    """The sample: by file number; the LDC release: sections 02-21 / 22 / 23."""
    assert detect_split(SAMPLE_IDS) == "sample" and detect_split(LDC_IDS) == "ldc"
    assert [split_of(f, "sample") for f in SAMPLE_IDS] == ["train", "train", "dev", "test", "test"]
    assert [split_of(f, "ldc") for f in LDC_IDS] == [None, "train", "train", "dev", "test", None]
    assert split_of("wsj_0200", "sample") is None


# --------------------------------------------------------------------------- preparing
def read_out(out: Path, split: str) -> tuple[list[str], list[str], list[str]]:
    return tuple(  # type: ignore[return-value]
        (out / f"{split}.{ext}").read_text().splitlines() for ext in ("trees", "words", "lin")
    )


def test_prepare_writes_aligned_splits_and_a_manifest(tmp_path: Path) -> None:
    files = mini_files(SAMPLE_IDS)
    files["wsj_0160"] += EMPTY  # a tree with no word left after cleaning: dropped, counted
    source = write_zip(tmp_path / "tb.zip", dict(files))
    out = tmp_path / "out"
    m = prepare_treebank(source, out)
    assert m == json.loads((out / MANIFEST_FILE).read_text())
    assert {p.name for p in out.iterdir()} == OUTPUT_FILES
    assert m["split"]["scheme"] == "sample" and m["split"]["requested"] == "auto"
    assert "detected" in m["split"]["summary"] and "wsj_0160-wsj_0179" in m["split"]["summary"]
    assert m["source"]["sha256"] == sha256_file(source) and m["source"]["kind"] == "zip"
    assert m["preprocessing_version"] == 1
    assert m["files"] == {name: sha256_file(out / name) for name in OUTPUT_FILES - {MANIFEST_FILE}}
    assert m["splits"]["train"] == {
        "files": 2,
        "trees": 4,
        "words": 4 * 4 - 2,  # the trace's sentence has 3 words after cleaning
        "constituents": 2 * (3 + 3),
        "max_words": 4,
        "max_lin_tokens": 10,
        "dropped_empty": 0,
    }
    assert m["splits"]["dev"]["trees"] == 2 and m["splits"]["dev"]["dropped_empty"] == 1
    trees, words, lin = read_out(out, "test")
    assert len(trees) == len(words) == len(lin) == 4
    assert trees[0] == "(S (VP (VBD ran) (ADVP (RB today))) (. .))"
    assert words[1] == "the wsj_0180 sat ." and lin[1] == "(S (NP XX XX )NP (VP XX )VP XX )S"
    linw = (out / "test.linw").read_text().splitlines()
    assert linw[1] == "(S (NP the wsj_0180 )NP (VP sat )VP . )S"
    for n, tree in read_tree_lines(out / "test.trees"):
        assert words[n - 1].split() == tree.leaves() and lin[n - 1] == linearize(tree)
        assert linw[n - 1] == linearize(tree, words=True)


def test_prepare_ldc_layout_and_forced_splits(tmp_path: Path) -> None:
    source = write_ldc(tmp_path / "ldc", mini_files(LDC_IDS))
    m = prepare_treebank(source, tmp_path / "out")
    assert m["split"]["scheme"] == "ldc" and m["source"] == {
        "path": str(source.resolve()),
        "kind": "directory",
        "sha256": None,
        "treebank_files": 6,
    }
    assert [m["splits"][s]["files"] for s in ("train", "dev", "test")] == [2, 1, 1]
    assert m["unused"] == {"files": 2, "trees": 4}  # sections 00 and 24
    with pytest.raises(InputError, match="the dev split is empty under the sample split"):
        prepare_treebank(source, tmp_path / "out2", split="sample")
    with pytest.raises(ValueError, match="split must be"):
        prepare_treebank(source, tmp_path / "out2", split="wsj")
    assert not (tmp_path / "out2").exists()


def test_prepare_refuses_an_output_holding_other_files(tmp_path: Path) -> None:
    """Only files it writes may be in the output directory: it replaces a previous run,
    never anything else; and a bad input leaves the previous run intact."""
    source = write_zip(tmp_path / "tb.zip", dict(mini_files(SAMPLE_IDS)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(UsageError, match="holds files prepare_treebank did not write.*notes.txt"):
        prepare_treebank(source, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    with pytest.raises(UsageError, match="is a file"):
        prepare_treebank(source, out / "notes.txt")
    (out / "notes.txt").unlink()
    first = prepare_treebank(source, out)
    assert prepare_treebank(source, out) == first  # a rerun replaces its own files
    bad = dict(mini_files(SAMPLE_IDS))
    bad["wsj_0199"] += "( (S (NP (DT a) )\n"
    with pytest.raises(InputError, match=r"wsj_0199\.mrg:4: unbalanced"):
        prepare_treebank(write_zip(tmp_path / "bad.zip", bad), out)
    assert json.loads((out / MANIFEST_FILE).read_text()) == first


# --------------------------------------------------------------------------- silver trees
def test_read_silver_and_pairs(tmp_path: Path) -> None:
    """Parser output (ROOT wrappers, one tree per line, gzip) cleaned like the gold."""
    lines = [
        "(ROOT (S (NP-SBJ (PRP It)) (VP (VBZ works)) (. .)))",
        EMPTY.strip(),
        "(TOP (FRAG (NP (NN Nothing)) (. !)))",
    ]
    silver = tmp_path / "silver.trees.gz"
    silver.write_bytes(gzip.compress("".join(x + "\n" for x in lines).encode()))
    assert [(n, tree.to_string()) for n, tree in read_silver(silver)] == [
        (1, "(S (NP (PRP It)) (VP (VBZ works)) (. .))"),
        (3, "(FRAG (NP (NN Nothing)) (. !))"),
    ]
    counts = tree_file_to_pairs(silver, tmp_path / "s.words", tmp_path / "s.lin")
    assert counts == {"pairs": 2, "words": 5}
    assert (tmp_path / "s.words").read_text() == "It works .\nNothing !\n"
    assert (tmp_path / "s.lin").read_text() == (
        "(S (NP XX )NP (VP XX )VP XX )S\n(FRAG (NP XX )NP XX )FRAG\n"
    )


def test_pairs_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.trees"
    bad.write_text("(S (NN a))\r\n(S (NN b)\r\n")
    with pytest.raises(InputError, match=rf"^{bad}:2: unbalanced"):
        tree_file_to_pairs(bad, tmp_path / "w", tmp_path / "l")
    assert not (tmp_path / "w").exists() and not (tmp_path / "l").exists()
    empty = tmp_path / "empty.trees"
    empty.write_text("")
    with pytest.raises(InputError, match="no trees"):
        tree_file_to_pairs(empty, tmp_path / "w", tmp_path / "l")
    with pytest.raises(UsageError, match="is also an input"):
        tree_file_to_pairs(bad, bad, tmp_path / "l")
    with pytest.raises(UsageError, match="are the same file"):
        tree_file_to_pairs(bad, tmp_path / "w", tmp_path / "w")


# --------------------------------------------------------------------------- the real sample
@pytest.fixture(scope="module")
def sample_trees() -> list[tuple[str, int, Tree]]:
    if not SAMPLE.is_file():
        pytest.skip(f"needs {SAMPLE}")
    return list(read_treebank(SAMPLE))


@needs_sample
def test_sample_counts_and_first_tree(sample_trees: list[tuple[str, int, Tree]]) -> None:
    """NLTK's sample: 199 files, 3,914 trees; wsj_0001's first tree cleaned by hand."""
    assert len(sample_trees) == 3914
    assert len({f for f, _, _ in sample_trees}) == 199
    file_id, line, first = sample_trees[0]
    assert (file_id, line) == (
        "wsj_0001",
        2,
    ) and first  # the file starts with a blank line == parse_tree(WSJ_0001_1)
    cleaned = clean(first)
    assert cleaned is not None and cleaned.to_string() == WSJ_0001_1_CLEAN
    assert " ".join(cleaned.leaves()) == (
        "Pierre Vinken , 61 years old , will join the board as a nonexecutive director Nov. 29 ."
    )
    per_split = collections.Counter(split_of(f, "sample") for f, _, _ in sample_trees)
    assert per_split == {"train": 3396, "dev": 273, "test": 245}


@needs_sample
def test_sample_round_trips_and_punctuation_tags(sample_trees: list[tuple[str, int, Tree]]) -> None:
    """Every sample tree survives linearize -> delinearize; the word-form tags agree with
    the gold tags EVALB deletes (, : `` '' .) for all but 2 of 10,729 words."""
    deleted, wrong = {",", ":", "``", "''", "."}, 0
    for _, _, raw in sample_trees:
        tree = clean(raw)
        assert tree is not None
        words, gold = tree.leaves(), tree.pos_tags()
        back, repairs = delinearize(linearize(tree), words, tags=gold)
        assert back == tree and repairs.total == 0
        tags = punctuation_tags(words)
        wrong += sum(g in deleted and t != g for g, t in zip(gold, tags, strict=True))
    assert wrong == 2  # "Wa" tagged ',' in the PTB; a quote's ' closing a nested `


@needs_sample
def test_prepare_the_sample(tmp_path: Path) -> None:
    m = prepare_treebank(SAMPLE, tmp_path / "ptb")
    assert m["split"]["scheme"] == "sample"
    assert {s: (v["files"], v["trees"]) for s, v in m["splits"].items()} == {
        "train": (159, 3396),
        "dev": (20, 273),
        "test": (20, 245),
    }
    trees, words, lin = read_out(tmp_path / "ptb", "train")
    assert trees[0] == WSJ_0001_1_CLEAN and words[0].startswith("Pierre Vinken , 61")
    assert lin[0].startswith("(S (NP (NP XX XX )NP XX (ADJP")
