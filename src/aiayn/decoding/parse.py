"""Parse sentences (section 6.3): translate words into a linearized tree, then rebuild it.

The model is a translation model whose target language is a linearized tree
(`aiayn.parsing.linearize.linearize`: "(S (NP Pierre Vinken )NP ... )S", or GAFL's XX for each
word); the same beam search decodes it, with the parser's settings (beam 21, alpha 0.3,
output length <= input + 300).

Two modes:

- constrained (the default): the search runs under `TreeConstraint`, which allows only
  tokens that keep the output a tree over exactly the input's words (a labelled open
  bracket, the innermost constituent's close bracket, the next word's pieces, EOS once the
  tree is whole), so every output is a tree by construction and nothing is repaired;
- unconstrained: the search writes what the model likes, and `delinearize` turns it into
  a well-formed tree over exactly the input's words, counting the repairs it made (the
  fallback, and the ablation that shows what the model alone writes).

The raw outputs are kept beside the trees, so a reader can see how often the model alone
produced a tree (the recipe's no-repair row).

Input lines are sentences of space-separated words, as the treebank tokenized them (the
`.words` files of `aiayn data ptb`). Brackets in words are written as the treebank writes
them (`escape_word`: "(" -> -LRB-, "(hello)" -> -LRB-hello-RRB-, "f(x)" -> f-LRB-x-RRB-),
so that the output stays one bracketed tree a line that EVALB reads; the original word is
the escaped one with -LRB-/-RRB- read back as brackets.
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

from aiayn.config import UNK_ID, DecodeConfig
from aiayn.decoding.translate import Decoder, SubwordTokenizer, read_input, translate_nbest
from aiayn.decoding.tree_constraint import Brackets, TreeConstraint, TreeLimits, bracket_tokens
from aiayn.files import InputError, atomic_write
from aiayn.parsing.linearize import Repairs, delinearize, punctuation_tag
from aiayn.parsing.trees import PLACEHOLDER

logger = logging.getLogger(__name__)

#: The treebank's spelling of brackets inside words (a bare one would end the tree early).
BRACKET_WORDS = {"(": "-LRB-", ")": "-RRB-", "{": "-LCB-", "}": "-RCB-", "[": "-LSB-", "]": "-RSB-"}


def escape_word(word: str) -> str:
    """A word as the treebank spells it: a bracket alone by its name (-LRB-, -RCB-, ...),
    a round bracket inside a word likewise ("f(x)" -> "f-LRB-x-RRB-"), which a tree
    reader (EVALB's included) would otherwise take for the tree's own brackets."""
    if word in BRACKET_WORDS:
        return BRACKET_WORDS[word]
    return word.replace("(", "-LRB-").replace(")", "-RRB-")


def sentence_words(line: str) -> list[str]:
    """The words of an input line, with brackets spelled as the treebank spells them."""
    return [escape_word(w) for w in line.split()]


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
    constrained: bool = False

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
            "constrained": self.constrained,
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


def constrained_text(
    ids: Sequence[int], pieces: Sequence[Sequence[int]], words: Sequence[str], brackets: Brackets
) -> str:
    """The linearized tree a constrained output's ids spell, each word's pieces replaced
    by the input's word (the pieces decode to the word only up to the tokenizer's
    normalisation and <unk>); the words are the input's by construction."""
    label = {i: "(" + lb for i, lb in zip(brackets.open_ids, brackets.labels, strict=True)}
    label.update({i: ")" + lb for i, lb in zip(brackets.close_ids, brackets.labels, strict=True)})
    out, w, at = [], 0, 0
    for i in ids:
        if at == 0 and i in label:
            out.append(label[i])
            continue
        at += 1
        if w < len(pieces) and at == len(pieces[w]):
            out.append(words[w])
            w, at = w + 1, 0
    return " ".join(out)


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
    constrained: bool = True,
    limits: TreeLimits | None = None,
    linearization: str = "words",
    word_mass: bool = False,
) -> ParseResult:
    """Parse each line (space-separated words) into a well-formed bracketed tree.

    Args:
        model, tokenizer, cfg, device, progress, workers: as `translate_nbest`.
        name: the input's name in error messages.
        constrained: decode under `TreeConstraint` (every output a tree by construction);
            False: decode freely and repair (`delinearize`).
        limits: the constraint's depth and open-run bounds (default: `TreeLimits()`;
            the recipe's come from its training trees, `tree_limits`).
        linearization: the model's target: "words" (each word in its place) or "gafl" (XX).
        word_mass: constrained, a word's pieces score the model's probability of writing
            any word there, not the input's piece (`TreeConstraint`): the structure decides.

    Raises:
        InputError: an empty line, named by FILE:LINE, before any decoding.
    """
    words = check_sentences(lines, name)
    start = time.perf_counter()
    # the model reads the words as the treebank spelled them, as in training
    sources = [" ".join(w) for w in words]
    constraint_for = None
    if constrained:
        brackets = bracket_tokens(tokenizer)
        written = (lambda x: x) if linearization == "words" else (lambda x: PLACEHOLDER)
        # a word the vocabulary has no piece for (e.g. U+FFFD from invalid UTF-8) is <unk>
        pieces = [[tokenizer.encode(written(x)) or [UNK_ID] for x in w] for w in words]
        vocab = int(tokenizer.vocab_size)  # type: ignore[attr-defined]

        def constraint_for(batch: list[int]) -> TreeConstraint:
            return TreeConstraint(
                [pieces[i] for i in batch],
                brackets,
                vocab,
                limits or TreeLimits(),
                device,
                word_mass=word_mass,
            )

    nbest, _ = translate_nbest(
        model, tokenizer, sources, cfg, device, progress, workers, constraint_for=constraint_for
    )
    result = ParseResult(trees=[], raw=[], words=words, constrained=constrained)
    for i, (outputs, w) in enumerate(zip(nbest, words, strict=True)):
        if constrained and outputs:
            raw = constrained_text(outputs[0].tokens, pieces[i], w, brackets)
        else:
            raw = outputs[0].text if outputs else ""
        tree, repairs = delinearize(raw, w)
        result.raw.append(raw)
        result.trees.append(tree.to_string())
        result.repairs = result.repairs + repairs
        if repairs.total:
            result.ill_formed.append(i)
        result.output_tokens += (
            len(outputs[0].tokens) if outputs and outputs[0].tokens else len(tokenizer.encode(raw))
        )
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
    constrained: bool = True,
    limits: TreeLimits | None = None,
    linearization: str = "words",
    word_mass: bool = False,
) -> tuple[ParseResult, dict[str, Any]]:
    """Parse a file (or stdin) of sentences into a file (atomically) or stdout, a tree a line.

    Args:
        raw_path: also write the model's raw linearized outputs here, a line each.
        constrained, limits, linearization, word_mass: as `parse_lines`.

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
        result = parse_lines(
            model,
            tokenizer,
            lines,
            cfg,
            device,
            progress,
            workers,
            name=name,
            constrained=constrained,
            limits=limits,
            linearization=linearization,
            word_mass=word_mass,
        )
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
