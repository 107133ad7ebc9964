"""Tests for aiayn.scoring.bleu: BLEU with its signature (paper section 6; RELIABILITY H1-H5)."""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sacrebleu

from aiayn.files import InputError, read_lines
from aiayn.scoring.bleu import Scores, lang_from_suffix, perplexity, score, score_files
from helpers import MULTI30K  # noqa: E402

REFS = [
    'Ein Mann (im Hemd) sagt: "Hallo!"',
    "Zwei Hunde spielen im Schnee.",
    "Eine Frau, die ein rotes Kleid trägt, läuft über die Straße.",
]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _drop_words(line: str, i: int) -> str:
    """A deterministic imperfect hypothesis: drop every (2 + i % 3)-th word."""
    words = line.split()
    k = 2 + i % 3
    return " ".join(w for j, w in enumerate(words, start=1) if j % k)


def test_perfect_hypothesis_scores_100() -> None:
    """Section 6 known answer: hypotheses equal to the references score 100 everywhere."""
    s = score(REFS, REFS, "de")
    assert s.sacrebleu == pytest.approx(100.0)
    assert s.chrf == pytest.approx(100.0)
    assert s.tok_bleu == pytest.approx(100.0)
    assert s.n_lines == 3


@pytest.mark.rows("H2")
def test_signatures_present() -> None:
    """H2: every score carries its full signature, and format() prints each of them."""
    s = score([_drop_words(r, i) for i, r in enumerate(REFS)], REFS, "de")
    assert s.sacrebleu < 100
    for part in ("nrefs:1", "case:mixed", "tok:13a", "smooth:exp", "version:2."):
        assert part in s.sacrebleu_signature
    for part in ("nrefs:1", "nc:6", "nw:0", "version:2."):
        assert part in s.chrf_signature
    for part in ("sacremoses-tok:de", "escape:no", "nrefs:1", "case:lc", "tok:none"):
        assert part in s.tok_bleu_signature
    text = s.format()
    for sig in (s.sacrebleu_signature, s.chrf_signature, s.tok_bleu_signature):
        assert sig in text
    assert f"{s.sacrebleu:.2f}" in text and f"{s.chrf:.2f}" in text
    d = s.to_dict()
    assert d["n_lines"] == 3 and d["sacrebleu_signature"] == s.sacrebleu_signature
    assert Scores(**d) == s


@pytest.mark.rows("H3")
def test_deterministic() -> None:
    """H3: the same input scored twice gives identical scores and signatures."""
    hyps = [_drop_words(r, i) for i, r in enumerate(REFS)]
    assert score(hyps, REFS, "de").to_dict() == score(hyps, REFS, "de").to_dict()


@pytest.mark.rows("H3")
@pytest.mark.skipif(not (MULTI30K / "val.de.gz").exists(), reason="Multi30k data missing")
def test_api_equals_cli(tmp_path: Path) -> None:
    """H3: our scores and signatures equal the sacrebleu CLI's on real Multi30k lines."""
    refs = list(read_lines(MULTI30K / "val.de.gz"))[:200]
    hyps = [_drop_words(r, i) if i % 2 else r for i, r in enumerate(refs)]
    ref_file = _write(tmp_path / "val.de", refs)
    hyp_file = _write(tmp_path / "hyp.de", hyps)
    ours = score_files(hyp_file, ref_file)
    assert 20 < ours.sacrebleu < 95  # a real, imperfect score

    def cli(*args: str) -> str:
        cmd = [sys.executable, "-m", "sacrebleu", str(ref_file), "-i", str(hyp_file), *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()

    assert cli("-b") == f"{ours.sacrebleu:.1f}"  # the CLI's default width is 1
    bleu, chrf = json.loads(cli("-m", "bleu", "chrf", "-w", "4"))
    assert bleu["score"] == float(f"{ours.sacrebleu:.4f}")
    assert bleu["signature"] == ours.sacrebleu_signature
    assert chrf["score"] == float(f"{ours.chrf:.4f}")
    assert chrf["signature"] == ours.chrf_signature


def test_tok_bleu_is_lowercased_moses_bleu() -> None:
    """Multi30k convention: tok_bleu equals BLEU on hand-tokenized lowercased text."""
    hyps = ['Ein Mann (im Hemd) sagt: "Hallo"', "zwei Hunde spielen im Schnee."]
    refs = ['ein Mann (im Hemd) sagt: "Hallo!"', "Zwei Hunde spielen im Schnee."]
    # tokenizer.perl -l de output, lowercased, written out by hand
    hyps_tok = ['ein mann ( im hemd ) sagt : " hallo "', "zwei hunde spielen im schnee ."]
    refs_tok = ['ein mann ( im hemd ) sagt : " hallo ! "', "zwei hunde spielen im schnee ."]
    s = score(hyps, refs, "de")
    expected = sacrebleu.corpus_bleu(hyps_tok, [refs_tok], tokenize="none", force=True)
    assert s.tok_bleu == expected.score
    # the tokenization matters: the same strings merely lowercased score differently
    untok = sacrebleu.corpus_bleu(
        [h.lower() for h in hyps], [[r.lower() for r in refs]], tokenize="none", force=True
    )
    assert untok.score != expected.score


def test_tok_bleu_ignores_case_sacrebleu_does_not() -> None:
    """Multi30k convention: a hypothesis differing only in case is perfect in tok_bleu only."""
    # ASCII only: "ß".upper() is "SS", which lowercases to "ss", a different word
    hyps = ["".join(c.upper() if c.isascii() else c for c in r) for r in REFS]
    s = score(hyps, REFS, "de")
    assert s.tok_bleu == pytest.approx(100.0)
    assert s.sacrebleu < 50


@pytest.mark.rows("H1")
def test_line_count_mismatch_names_both_files(tmp_path: Path) -> None:
    """H1: differing line counts are an error naming both files and both counts."""
    # why the check is ours: the sacrebleu API scores 1 hypothesis vs 3 references as 100
    assert sacrebleu.corpus_bleu(REFS[:1], [REFS]).score == pytest.approx(100.0)
    hyp = _write(tmp_path / "hyp.de", REFS[:1])
    ref = _write(tmp_path / "ref.de", REFS)
    with pytest.raises(ValueError) as e:
        score_files(hyp, ref)
    msg = str(e.value)
    assert str(hyp) in msg and str(ref) in msg
    assert "1 lines" in msg and "3 lines" in msg
    with pytest.raises(ValueError, match="1 lines.*3 lines"):
        score(REFS[:1], REFS, "de")


def test_references_from_a_pipe(tmp_path: Path) -> None:
    """`--ref <(zcat ref.gz)`: a pipe (here a FIFO fed gzip bytes) scores as the file does;
    a directory or a missing path is an error naming it."""
    refs = list(read_lines(MULTI30K / "val.de.gz"))[:100]
    ref_file = _write(tmp_path / "ref.de", refs)
    hyp_file = _write(tmp_path / "hyp.de", [_drop_words(r, i) for i, r in enumerate(refs)])
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    payload = gzip.compress(ref_file.read_bytes())

    def feed() -> None:
        with open(fifo, "wb") as f:
            f.write(payload)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        piped = score_files(hyp_file, fifo, "de")
    finally:
        writer.join(timeout=10)
    assert piped == score_files(hyp_file, ref_file, "de")
    with pytest.raises(InputError, match="is a directory"):
        score_files(hyp_file, tmp_path, "de")
    with pytest.raises(InputError, match="nope.de: no such file"):
        score_files(hyp_file, tmp_path / "nope.de", "de")


@pytest.mark.rows("H4")
def test_empty_hypotheses_kept(tmp_path: Path) -> None:
    """H4: empty hypotheses are kept and scored: all empty gives 0, alignment is intact."""
    s = score(["", "", ""], REFS, "de")
    assert (s.sacrebleu, s.chrf, s.tok_bleu, s.n_lines) == (0.0, 0.0, 0.0, 3)
    hyp = _write(tmp_path / "hyp.de", ["", REFS[1], ""])
    ref = _write(tmp_path / "ref.de", REFS)
    s = score_files(hyp, ref)
    assert s.n_lines == 3
    assert s.sacrebleu == sacrebleu.corpus_bleu(["", REFS[1], ""], [REFS]).score
    # had the empty lines been dropped, the remaining line would meet the wrong reference
    assert s.sacrebleu != sacrebleu.corpus_bleu([REFS[1]], [REFS[:1]]).score


@pytest.mark.rows("H5")
def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    """H5: invalid UTF-8 in the hypotheses is an error naming the file and the line."""
    hyp = tmp_path / "hyp.de"
    hyp.write_bytes(b"Zwei Hunde\nd\xe9j\xe0 vu\nok\n")
    ref = _write(tmp_path / "ref.de", REFS)
    with pytest.raises(InputError, match=f"{hyp}:2"):
        score_files(hyp, ref)


@pytest.mark.rows("H2")
@pytest.mark.parametrize("bad", ["▁Ein ▁Mann", "Ein Ma@@ nn"])
def test_subword_markers_rejected(bad: str, tmp_path: Path) -> None:
    """H2: BLEU is computed on detokenized text with subwords removed."""
    hyps = [REFS[0], bad, REFS[2]]
    assert score([REFS[0], "@@", REFS[2]], REFS, "de").n_lines == 3  # a real "@@" caption
    with pytest.raises(ValueError, match="hypotheses:2: subword marker"):
        score(hyps, REFS, "de")
    hyp = _write(tmp_path / "hyp.de", hyps)
    ref = _write(tmp_path / "ref.de", REFS)
    with pytest.raises(ValueError, match=f"{hyp}:2"):
        score_files(hyp, ref)


@pytest.mark.rows("H2")
def test_tokenized_input_warning_shown(caplog: pytest.LogCaptureFixture) -> None:
    """H2: sacrebleu's warning for output that looks tokenized reaches the log."""
    hyps = [f"Ein Mann sitzt auf Bank {i} ." for i in range(100)]
    with caplog.at_level(logging.WARNING):
        score(hyps, hyps, "de")
    assert "detokenize" in caplog.text


def test_target_lang_from_ref_suffix(tmp_path: Path) -> None:
    """The Moses tokenizer's language comes from the reference file name, else "en"."""
    assert lang_from_suffix("data/test_2016_flickr.de") == "de"
    assert lang_from_suffix("data/test_2016_flickr.fr.gz") == "fr"
    assert lang_from_suffix("hyp.txt") == "en"
    assert lang_from_suffix("refs") == "en"
    ref = _write(tmp_path / "test_2016_flickr.fr", ["Un homme ."])
    hyp = _write(tmp_path / "hyp.txt", ["Un homme ."])
    assert "sacremoses-tok:fr|" in score_files(hyp, ref).tok_bleu_signature
    assert "sacremoses-tok:de|" in score_files(hyp, ref, "de").tok_bleu_signature


def test_perplexity() -> None:
    """Section 6.2 (Table 3 PPL): perplexity is exp of the mean per-token NLL."""
    V, n = 37, 11
    assert perplexity(n * math.log(V), n) == pytest.approx(V)  # uniform over V words
    assert perplexity(0.0, 5) == 1.0
    assert perplexity(6.0, 3) == pytest.approx(math.exp(2.0))
    assert perplexity(1e6, 1) == math.inf
    with pytest.raises(ValueError, match="n_tokens"):
        perplexity(1.0, 0)


@pytest.mark.rows("H6")
def test_bootstrap_interval_is_seeded_and_in_the_signature(tmp_path: Path) -> None:
    """H6: the bootstrap confidence interval uses sacrebleu's fixed seed, recorded in the
    signature (bs:N|seed:12345); the same files give the same interval twice, and it
    agrees with sacrebleu's own CLI (--confidence)."""
    refs = list(read_lines(MULTI30K / "val.de.gz"))[:100] if MULTI30K.is_dir() else REFS * 30
    hyps = [_drop_words(r, i) for i, r in enumerate(refs)]
    a = score(hyps, refs, "de", bootstrap=200)
    b = score(hyps, refs, "de", bootstrap=200)
    assert a.sacrebleu_ci is not None and a.sacrebleu_ci > 0 and a == b
    assert "bs:200|seed:12345" in a.sacrebleu_signature
    assert "+- " in a.format()
    assert score(hyps, refs, "de").sacrebleu_ci is None
    hyp, ref = _write(tmp_path / "hyp.de", hyps), _write(tmp_path / "ref.de", refs)
    cli = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sacrebleu",
                str(ref),
                "-i",
                str(hyp),
                "-m",
                "bleu",
                "--confidence",
                "--confidence-n",
                "200",
                "-w",
                "2",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert cli["signature"] == a.sacrebleu_signature
    assert cli["confidence"].endswith(f"± {a.sacrebleu_ci:.2f}")
    with pytest.raises(ValueError, match="bootstrap"):
        score(hyps, refs, "de", bootstrap=1)


# ------------------------------------------------------------------------- the paper's BLEU
def test_compound_splitting_is_get_ende_bleu_sh_perl_on_the_same_lines() -> None:
    """tensor2tensor's own one-liner, run by perl, is the second implementation."""
    import random
    import shutil

    from aiayn.scoring.bleu import split_compounds

    if shutil.which("perl") is None:
        pytest.skip("needs perl")
    rng = random.Random(0)
    lines = [
        "state-of-the-art",
        "a-b-c",
        "3-4 Hand-in-Hand",
        "- leading and trailing -",
        "x -y z- w",
        "Nord-Süd-Verbindung ( E-Mail )",
        *("".join(rng.choice("ab- ÄöX") for _ in range(rng.randint(0, 30))) for _ in range(300)),
    ]
    perl = subprocess.run(
        ["perl", "-CSD", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        check=True,
    )
    assert [split_compounds(line) for line in lines] == perl.stdout.split("\n")[:-1]


def test_paper_bleu_is_cased_tokenized_unsmoothed_bleu_on_split_compounds() -> None:
    hyps = ["Das ist ein Test-Fall .", "Der Hund läuft schnell.", "Ein Mann"]
    refs = ["Das ist ein Test-Beispiel .", "Der Hund rennt schnell.", "Ein Mann schläft ."]
    s = score(hyps, refs, "de")
    by_hand = sacrebleu.metrics.BLEU(tokenize="none", smooth_method="none", force=True)
    tokenized_hyps = [
        "Das ist ein Test ##AT##-##AT## Fall .",
        "Der Hund läuft schnell .",
        "Ein Mann",
    ]
    tokenized_refs = [
        "Das ist ein Test ##AT##-##AT## Beispiel .",
        "Der Hund rennt schnell .",
        "Ein Mann schläft .",
    ]
    assert s.paper_bleu == by_hand.corpus_score(tokenized_hyps, [tokenized_refs]).score
    assert "compound-split:##AT##" in s.paper_bleu_signature
    assert "case:mixed" in s.paper_bleu_signature and "smooth:none" in s.paper_bleu_signature
    # the half-right compound earns n-grams that the unsplit token does not
    unsplit = by_hand.corpus_score(
        [h.replace(" ##AT##-##AT## ", "-") for h in tokenized_hyps],
        [[r.replace(" ##AT##-##AT## ", "-") for r in tokenized_refs]],
    )
    assert s.paper_bleu > unsplit.score
    # cased: a case change costs here, not in tok-BLEU
    lower = score([h.lower() for h in hyps], refs, "de")
    assert lower.paper_bleu < s.paper_bleu and lower.tok_bleu == s.tok_bleu


def test_paper_bleu_splits_compounds_only_for_german() -> None:
    hyp, ref = ["la ville est un état-major du pays ."], ["la ville est un état-civil du pays ."]
    fr, de = score(hyp, ref, "fr"), score(hyp, ref, "de")
    assert "compound-split:no" in fr.paper_bleu_signature
    assert "compound-split:##AT##" in de.paper_bleu_signature
    assert fr.paper_bleu < de.paper_bleu  # only German's split gives "état ##AT##-##AT##" credit
    assert score(ref, ref, "fr").paper_bleu == pytest.approx(100.0)
