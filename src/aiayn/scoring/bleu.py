"""Evaluation (paper section 6): BLEU on detokenized text, chrF, and perplexity.

Every score comes from sacrebleu's Python API, never from a hand-written BLEU, and is
reported with its full signature so that it can be reproduced (RELIABILITY H2, H3):

- ``sacrebleu``: BLEU with sacrebleu's defaults (13a tokenization, mixed case, exp
  smoothing) on detokenized text, the number comparable across papers.
- ``chrf``: chrF2 with sacrebleu's defaults (character 6-grams, no word n-grams).
- ``tok_bleu``: the "multi-bleu style" BLEU of the Multi30k literature (e.g. Wu et al.,
  2021, who report fairseq's BLEU on lowercased Moses-tokenized text). Hypotheses and
  references are Moses-tokenized by sacremoses (``MosesTokenizer(lang).tokenize(escape=
  False)``, i.e. tokenizer.perl without -a and without XML escaping), then scored by
  sacrebleu with ``lowercase=True, tokenize="none"``: lowercasing follows tokenization,
  as with ``tokenizer.perl | multi-bleu.perl -lc``. Only comparable with numbers computed
  the same way.
- ``paper_bleu``: the number the paper's Table 2 printed: cased BLEU on Moses-tokenized
  text, without smoothing (multi-bleu.perl), and for a German target with compounds split
  at hyphens, "a-b" -> "a ##AT##-##AT## b", as tensor2tensor's get_ende_bleu.sh does
  (the script behind the paper's En-De scores): a hyphenated compound that is half right
  earns n-grams. Only comparable with numbers computed the same way.

The sacrebleu API checks neither that hypotheses and references line up nor their
encoding: with 1 hypothesis and 3 references it returns BLEU 100 (RELIABILITY E8). So
this module checks line counts (H1) and reads files through `aiayn.files.read_lines`
(invalid UTF-8 names the file and line, H5); empty hypotheses are kept and scored (H4);
subword markers ("▁", "@@ ") left in hypotheses or references are refused (H2:
"detokenized, BPE removed").
Trailing whitespace is stripped from each line, as the sacrebleu CLI does, so API and
CLI give identical scores (H3). Bootstrap resampling (`bootstrap=N`, for a 95% confidence
interval of sacreBLEU) draws with sacrebleu's fixed seed (SACREBLEU_SEED, default 12345),
and the signature records both (bs:N|seed:S, H6), so it is deterministic too.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF

from aiayn.files import read_lines

log = logging.getLogger(__name__)

SPM_MARKER = "\u2581"  # sentencepiece's word-boundary "▁"
BPE_MARKER = "@@ "  # subword-nmt's continuation marker between pieces


@dataclass
class Scores:
    """Corpus-level scores of one hypothesis file against one reference file (1 ref)."""

    sacrebleu: float
    sacrebleu_signature: str
    chrf: float
    chrf_signature: str
    tok_bleu: float
    tok_bleu_signature: str
    paper_bleu: float
    paper_bleu_signature: str
    n_lines: int
    sacrebleu_ci: float | None = None  # half-width of the 95% bootstrap interval

    def to_dict(self) -> dict[str, float | str | int]:
        return asdict(self)

    def format(self) -> str:
        """A human-readable summary: each score with its full signature."""
        return "\n".join(
            [
                f"BLEU     = {self.sacrebleu:.2f}"
                + (f" +- {self.sacrebleu_ci:.2f}" if self.sacrebleu_ci is not None else "")
                + f"  ({self.sacrebleu_signature})",
                f"chrF2    = {self.chrf:.2f}  ({self.chrf_signature})",
                f"tok-BLEU = {self.tok_bleu:.2f}  ({self.tok_bleu_signature})",
                "           (lowercased, Moses-tokenized, multi-bleu style: "
                "not comparable with BLEU)",
                f"paper    = {self.paper_bleu:.2f}  ({self.paper_bleu_signature})",
                "           (the paper's Table 2 convention: cased, Moses-tokenized, "
                "compounds split at hyphens for German, unsmoothed)",
                f"lines    = {self.n_lines}",
            ]
        )


def score(hyps: list[str], refs: list[str], target_lang: str, *, bootstrap: int = 0) -> Scores:
    """Score detokenized hypotheses against references, one reference per line.

    Args:
        hyps: system outputs, detokenized, subwords removed; empty strings are scored.
        refs: references, aligned with `hyps` line by line.
        target_lang: language code of the target side (for the Moses tokenizer of
            tok_bleu), e.g. "de".
        bootstrap: resamples for sacreBLEU's 95% confidence interval (0 = none).

    Returns:
        Scores, from sacrebleu, each with its signature.

    Raises:
        ValueError: the line counts differ, there are no lines, or a hypothesis still
            contains subword markers.
    """
    return _score(
        hyps, refs, target_lang, hyp_name="hypotheses", ref_name="references", bootstrap=bootstrap
    )


def sacrebleu_only(hyps: list[str], refs: list[str]) -> tuple[float, str]:
    """sacreBLEU alone (defaults, as `score`), and its signature: the trainer's valid BLEU,
    every N steps, where tok-BLEU's Moses tokenizing and chrF would be wasted work.

    Hypotheses decoded by the run's own vocabulary hold no subword markers, so they are
    not searched for them; lines are right-stripped as in `score` (H3).
    Raises:
        ValueError: the line counts differ, or there are no lines.
    """
    if len(hyps) != len(refs):
        raise ValueError(f"line counts differ: {len(hyps)} hypotheses, {len(refs)} references")
    if not hyps:
        raise ValueError("nothing to score: no hypotheses")
    bleu = BLEU()
    result = bleu.corpus_score([h.rstrip() for h in hyps], [[r.rstrip() for r in refs]])
    return result.score, bleu.get_signature().format()


def score_files(
    hyp_path: str | Path,
    ref_path: str | Path,
    target_lang: str | None = None,
    *,
    bootstrap: int = 0,
) -> Scores:
    """Score a hypothesis file against a reference file (plain or .gz, UTF-8).

    Args:
        hyp_path: detokenized system output, one sentence per line.
        ref_path: references, one per line.
        target_lang: defaults to the reference file's language suffix
            (test_2016_flickr.de or .de.gz -> "de"), else "en".

    Raises:
        InputError: invalid UTF-8; the message names the file and line (H5).
        ValueError: the line counts differ (the message names both files and both
            counts, H1), or subword markers are left in the hypotheses (H2).
    """
    if target_lang is not None:
        check_language(target_lang)  # before reading anything
    hyps = list(read_lines(hyp_path))
    refs = list(read_lines(ref_path))
    if target_lang is None:
        target_lang = lang_from_suffix(ref_path)
    return _score(
        hyps, refs, target_lang, hyp_name=str(hyp_path), ref_name=str(ref_path), bootstrap=bootstrap
    )


def lang_from_suffix(path: str | Path, default: str = "en") -> str:
    """The language code in a file name's suffix (x.de, x.de.gz), if Moses knows it."""
    name = Path(path).name
    if name.endswith(".gz"):
        name = name[: -len(".gz")]
    suffix = Path(name).suffix.lstrip(".").lower()
    # only codes with Moses nonbreaking prefixes count, so "hyp.txt" is not language "txt"
    return suffix if suffix in known_languages() else default


@functools.cache
def known_languages() -> frozenset[str]:
    """The language codes the Moses tokenizer of tok-BLEU knows (its nonbreaking prefixes)."""
    # imported here: importing sacremoses sets KMP_INIT_AT_FORK (through joblib), and
    # `import aiayn` must change nothing global
    from sacremoses.corpus import NonbreakingPrefixes

    return frozenset(NonbreakingPrefixes().available_langs.values())


def check_language(lang: str) -> str:
    """`lang` if the Moses tokenizer knows it, else a ValueError listing the codes it knows:
    an unknown code would tokenize as English and be written into the signature."""
    known = known_languages()
    if lang not in known:
        raise ValueError(
            f"unknown target language {lang!r} for tok-BLEU's Moses tokenizer; known: "
            f"{', '.join(sorted(known))}"
        )
    return lang


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """Per-token perplexity exp(nll_sum / n_tokens), with the NLL in nats.

    Overflow gives inf rather than an error (an untrained model can exceed exp(709)).
    """
    if n_tokens <= 0:
        raise ValueError(f"perplexity needs n_tokens > 0, got {n_tokens}")
    mean = nll_sum / n_tokens
    return math.inf if mean > 709.0 else math.exp(mean)


def _score(
    hyps: list[str],
    refs: list[str],
    target_lang: str,
    *,
    hyp_name: str,
    ref_name: str,
    bootstrap: int = 0,
) -> Scores:
    if bootstrap < 0 or bootstrap == 1:
        raise ValueError(f"bootstrap must be 0 (off) or >= 2 resamples, got {bootstrap}")
    if len(hyps) != len(refs):
        raise ValueError(
            f"line counts differ: {hyp_name} has {len(hyps)} lines, "
            f"{ref_name} has {len(refs)} lines"
        )
    if not hyps:
        raise ValueError(f"nothing to score: {hyp_name} and {ref_name} are empty")
    _check_no_subwords(hyps, hyp_name)
    _check_no_subwords(refs, ref_name)
    hyps = [h.rstrip() for h in hyps]  # as the sacrebleu CLI does: API == CLI (H3)
    refs = [r.rstrip() for r in refs]
    n_empty = sum(1 for h in hyps if not h)
    if n_empty:
        log.warning(
            "%s: %d of %d hypotheses are empty (kept and scored)", hyp_name, n_empty, len(hyps)
        )

    # force=False keeps sacrebleu's warning for output that looks tokenized (H2)
    bleu = BLEU()
    bleu_score = bleu.corpus_score(hyps, [refs], n_bootstrap=max(bootstrap, 1))
    chrf = CHRF()
    chrf_score = chrf.corpus_score(hyps, [refs])
    tok_bleu, tok_sig = _tok_bleu(hyps, refs, target_lang)
    paper_bleu, paper_sig = _paper_bleu(hyps, refs, target_lang)
    return Scores(
        sacrebleu=bleu_score.score,
        sacrebleu_signature=bleu.get_signature().format(),
        chrf=chrf_score.score,
        chrf_signature=chrf.get_signature().format(),
        tok_bleu=tok_bleu,
        tok_bleu_signature=tok_sig,
        paper_bleu=paper_bleu,
        paper_bleu_signature=paper_sig,
        n_lines=len(hyps),
        # sacrebleu keeps the interval only in `_ci` (its own CLI reads it there too)
        sacrebleu_ci=bleu_score._ci if bootstrap else None,
    )


def _moses_bleu(
    hyps: list[str],
    refs: list[str],
    target_lang: str,
    bleu: BLEU,
    tokenizer_signature: str,
    post: Callable[[str], str] | None = None,
) -> tuple[float, str]:
    """`bleu` (sacrebleu, tokenize="none") on Moses-tokenized text, each tokenized line
    passed through `post` when given; the signature names the tokenizer first."""
    import sacremoses  # imported here: see above

    moses = sacremoses.MosesTokenizer(lang=target_lang)

    def tok(s: str) -> str:
        t = moses.tokenize(s, escape=False, return_str=True)
        return post(t) if post else t

    result = bleu.corpus_score([tok(h) for h in hyps], [[tok(r) for r in refs]])
    signature = (
        f"sacremoses-tok:{target_lang}|escape:no|{tokenizer_signature}|"
        f"sacremoses:{version('sacremoses')}|then sacrebleu:"
        f"{bleu.get_signature().format()}"
    )
    return result.score, signature


def _tok_bleu(hyps: list[str], refs: list[str], target_lang: str) -> tuple[float, str]:
    """Lowercased BLEU on Moses-tokenized text (multi-bleu style), and its signature."""
    # Moses' nonbreaking prefixes are case-sensitive, so tokenize first, then lowercase
    # (inside sacrebleu, recorded as case:lc); tokenize="none" splits on spaces only
    bleu = BLEU(lowercase=True, tokenize="none", force=True)
    return _moses_bleu(hyps, refs, target_lang, bleu, "aggressive-dash:no")


#: tensor2tensor's get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'
_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(text: str) -> str:
    """ "a-b" -> "a ##AT##-##AT## b" on Moses-tokenized text, as get_ende_bleu.sh does.

    Perl's s///g resumes after each match, so in "a-b-c" the second hyphen (whose left
    character the first match consumed) is not split; `re.sub` scans the same way.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def _paper_bleu(hyps: list[str], refs: list[str], target_lang: str) -> tuple[float, str]:
    """Cased, unsmoothed BLEU on Moses-tokenized text, compounds split for German."""
    split = target_lang == "de"
    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    return _moses_bleu(
        hyps,
        refs,
        target_lang,
        bleu,
        f"compound-split:{'##AT##' if split else 'no'}",
        split_compounds if split else None,
    )


def _check_no_subwords(lines: list[str], name: str) -> None:
    """Refuse text that still holds sentencepiece or BPE markers (H2)."""
    for lineno, line in enumerate(lines, start=1):
        # a lone trailing "@@" is not checked: the Multi30k training text has "@@" lines
        if SPM_MARKER in line or BPE_MARKER in line:
            marker = SPM_MARKER if SPM_MARKER in line else BPE_MARKER
            raise ValueError(
                f"{name}:{lineno}: subword marker {marker!r} left in the text; "
                "BLEU is computed on detokenized text with subwords removed "
                f"(line: {line[:80]!r})"
            )
