"""One-tree-per-line treebank files as parsers ship them (`02-21.10way.clean`,
`22.auto.clean`, `23.auto.clean`), with or without an outer (TOP ...) or ( ...): read by
`aiayn data ptb --from DIR` or named split by split with --train/--dev/--test."""

from __future__ import annotations

import json

import pytest

from aiayn.cli import main
from aiayn.files import InputError
from aiayn.parsing.ptb import prepare_treebank

TREES = {
    # the three wrappers a file may have: TOP, the PTB's empty label, none
    "02-21.10way.clean": [
        "(TOP (S (NP (DT The) (NN cat)) (VP (VBD sat)) (. .)))",
        "( (S (NP-SBJ (NNP Pierre)) (VP (VBD left) (NP (-NONE- *T*-1))) (. .)) )",
        "(S (NP (PRP It)) (VP (VBD rained)))",
    ],
    "22.auto.clean": ["(TOP (S (NP (NNS Dogs)) (VP (VBP bark))))"],
    "23.auto.clean": ["(TOP (FRAG (NP (DT A) (NN test)) (. .)))"],
}


def write(folder, names=TREES):
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in names.items():
        (folder / name).write_text("".join(f"{t}\n" for t in lines))
    return folder


def test_a_folder_of_the_usual_files_is_read_by_name(tmp_path):
    src = write(tmp_path / "wsj")
    manifest = prepare_treebank(src, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "train.trees").read_text().splitlines() == [
        "(S (NP (DT The) (NN cat)) (VP (VBD sat)) (. .))",
        "(S (NP (NNP Pierre)) (VP (VBD left)) (. .))",  # trace, tags and wrapper gone
        "(S (NP (PRP It)) (VP (VBD rained)))",
    ]
    assert (out / "dev.words").read_text() == "Dogs bark\n"
    assert (out / "test.linw").read_text() == "(FRAG (NP A test )NP . )FRAG\n"
    assert manifest["source"]["kind"] == "lines" and manifest["splits"]["train"]["trees"] == 3
    assert manifest["split"]["scheme"] == "files"


def test_the_cli_reads_a_folder_and_files_named_by_flag(tmp_path, capsys):
    src = write(tmp_path / "wsj")
    assert main(["data", "ptb", "--from", str(src), "--out", str(tmp_path / "a")]) == 0
    # the same files under other names, given split by split (relative to --from)
    other = write(tmp_path / "mine", {"tr.txt": TREES["02-21.10way.clean"],
                                      "dv.txt": TREES["22.auto.clean"],
                                      "te.txt": TREES["23.auto.clean"]})  # fmt: skip
    args = ["data", "ptb", "--from", str(other), "--out", str(tmp_path / "b")]
    assert main([*args, "--train", "tr.txt", "--dev", "dv.txt", "--test", "te.txt"]) == 0
    for name in ("train.trees", "dev.trees", "test.trees", "train.linw"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["source"]["files"]["dev"].endswith("dv.txt")


def test_missing_splits_and_bad_lines_are_errors_naming_them(tmp_path):
    src = write(tmp_path / "wsj", {"02-21.10way.clean": TREES["02-21.10way.clean"]})
    with pytest.raises(InputError, match="no dev or test file.*22.auto.clean"):
        prepare_treebank(src, tmp_path / "out")
    bad = write(tmp_path / "bad", {**TREES, "22.auto.clean": ["(TOP (S (NP (NNS Dogs)"]})
    with pytest.raises(InputError, match=r"22.auto.clean:1: unbalanced bracket"):
        prepare_treebank(bad, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()  # nothing written before every check passed
    single = bad / "02-21.10way.clean"
    with pytest.raises(InputError, match="not a zip archive; a file of one tree a line"):
        prepare_treebank(single, tmp_path / "out3")
    assert main(["data", "ptb", "--train", str(single), "--out", str(tmp_path / "c")]) != 0
