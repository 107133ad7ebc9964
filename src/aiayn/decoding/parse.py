"""Parse sentences (section 6.3): translate words into a linearized tree, then rebuild it.

The model is a translation model whose target language is the GAFL linearization of a
tree (`aiayn.parsing.trees.linearize`: "(S (NP XX XX )NP ... )S"); the same beam search
decodes it, with the parser's settings (beam 21, alpha 0.3, output length <= input + 300).
What the search returns need not be a tree: `delinearize` turns any output into a
well-formed tree over exactly the input's words, counting the repairs it made, so that
`parse_lines` never emits an ill-formed tree. The raw outputs are kept beside the trees,
so a reader can see how often the model alone produced a tree (the recipe's no-repair row).

Input lines are sentences of space-separated words, as the treebank tokenized them (the
`.words` files of `aiayn data ptb`). A bracket in a word is written as the treebank
writes it (-LRB-, -RRB-), so that the output stays one bracketed tree a line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aiayn.config import DecodeConfig
from aiayn.decoding.translate import Decoder, SubwordTokenizer, read_input, translate_nbest
from aiayn.files import InputError, atomic_write
from aiayn.parsing.trees import Repairs, delinearize, punctuation_tag

logger = logging.getLogger(__name__)

#: The treebank's spelling of brackets inside words (a bare one would end the tree early).
BRACKET_WORDS = {"(": "-LRB-", ")": "-RRB-", "{": "-LCB-", "}": "-RCB-", "[": "-LSB-", "]": "-RSB-"}


def sentence_words(line: str) -> list[str]:
    """The words of an input line, with brackets spelled as the treebank spells them."""
    return [BRACKET_WORDS.get(w, w) for w in line.split()]


def flat_tree(words: list[str]) -> str:
    """A tree with no constituent: what the no-repair row scores for an ill-formed output.

    Its root is TOP, a label EVALB's COLLINS.prm deletes, so the sentence adds its gold
    brackets to recall's denominator and nothing to precision's.
    """
    return "(TOP " + " ".join(f"({punctuation_tag(w)} {w})" for w in words) + ")"


@dataclass
class ParseResult:
    """The trees of some sentences, the model's raw outputs, and what repairing them took.

    `ill_formed` counts sentences whose raw output was not a linearized tree over their
    words (a repair was needed); `repairs` sums the repairs by kind.
    """

    trees: list[str]
    raw: list[str]
    words: list[list[str]]
    repairs: Repairs = field(default_factory=Repairs)
    ill_formed: list[int] = field(default_factory=list)  # 0-based indices
    output_tokens: int = 0  # subwords the search emitted, EOS excluded
    seconds: float = 0.0

    def unrepaired(self) -> list[str]:
        """Each sentence's tree where the raw output was well-formed, else `flat_tree`."""
        bad = set(self.ill_formed)
        return [
            flat_tree(w) if i in bad else t
            for i, (t, w) in enumerate(zip(self.trees, self.words, strict=True))
        ]

    def summary(self) -> dict[str, Any]:
        n = len(self.trees)
        return {
            "sentences": n,
            "ill_formed": len(self.ill_formed),
            "ill_formed_fraction": len(self.ill_formed) / n if n else 0.0,
            "repairs": self.repairs.to_dict(),
            "output_tokens": self.output_tokens,
            "seconds": self.seconds,
            "sentences_per_s": n / self.seconds if self.seconds > 0 else 0.0,
            "output_tokens_per_s": self.output_tokens / self.seconds if self.seconds > 0 else 0.0,
        }


def check_sentences(lines: Sequence[str], name: str) -> list[list[str]]:
    """The words of each line; an empty line is an error naming FILE:LINE (a tree needs a word)."""
    words = []
    for lineno, line in enumerate(lines, start=1):
        w = sentence_words(line)
        if not w:
            raise InputError(f"{name}:{lineno}: empty sentence: a parse needs at least one word")
        words.append(w)
    return words


def parse_lines(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    lines: Sequence[str],
    cfg: DecodeConfig,
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
    *,
    name: str = "<input>",
) -> ParseResult:
    """Parse each line (space-separated words) into a well-formed bracketed tree.

    Args:
        model, tokenizer, cfg, device, progress, workers: as `translate_nbest`.
        name: the input's name in error messages.

    Raises:
        InputError: an empty line, named by FILE:LINE, before any decoding.
    """
    words = check_sentences(lines, name)
    start = time.perf_counter()
    # the model reads the words as the treebank spelled them, as in training
    sources = [" ".join(w) for w in words]
    nbest, _ = translate_nbest(model, tokenizer, sources, cfg, device, progress, workers)
    result = ParseResult(trees=[], raw=[], words=words)
    for i, (outputs, w) in enumerate(zip(nbest, words, strict=True)):
        raw = outputs[0].text if outputs else ""
        tree, repairs = delinearize(raw, w)
        result.raw.append(raw)
        result.trees.append(tree.to_string())
        result.repairs = result.repairs + repairs
        if repairs.total:
            result.ill_formed.append(i)
        result.output_tokens += len(tokenizer.encode(raw))
    result.seconds = time.perf_counter() - start
    return result


def parse_file(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    input_path: str | Path | None,
    output_path: str | Path | None,
    cfg: DecodeConfig,
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
    *,
    raw_path: str | Path | None = None,
) -> tuple[ParseResult, dict[str, Any]]:
    """Parse a file (or stdin) of sentences into a file (atomically) or stdout, a tree a line.

    Args:
        raw_path: also write the model's raw linearized outputs here, a line each.

    Returns:
        The result and its summary (sentences, ill-formed raw outputs, repairs by kind,
        speed in sentences and output subwords per second; bad_utf8: lines with invalid
        UTF-8, replaced by U+FFFD as translate_file does, partial: whether there were any).
    """
    cfg.validate()
    name = str(input_path) if input_path is not None else "<stdin>"
    lines, bad = read_input(input_path)  # invalid UTF-8 replaced (U+FFFD), each line warned
    if not lines:
        logger.warning("%s: empty input, writing no trees", name)
    check_sentences(lines, name)  # before the outputs are opened, or any decoding
    with contextlib.ExitStack() as stack:
        out = None if output_path is None else stack.enter_context(atomic_write(output_path, "w"))
        raw_out = None if raw_path is None else stack.enter_context(atomic_write(raw_path, "w"))
        result = parse_lines(model, tokenizer, lines, cfg, device, progress, workers, name=name)
        text = "".join(f"{t}\n" for t in result.trees)
        if out is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            out.write(text)
        if raw_out is not None:
            raw_out.write("".join(f"{r}\n" for r in result.raw))
    # as `translate_file` (RELIABILITY F9): the trees are written, the result marked partial
    summary = {**result.summary(), "bad_utf8": len(bad), "partial": bool(bad)}
    if result.ill_formed:
        logger.info(
            "%d of %d outputs were not well-formed trees and were repaired (%s)",
            len(result.ill_formed),
            len(lines),
            ", ".join(f"{k} {v}" for k, v in result.repairs.to_dict().items() if v),
        )
    return result, summary
