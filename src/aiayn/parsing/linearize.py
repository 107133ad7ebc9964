"""The sequence a Transformer learns for a tree, and back (section 6.3).

`linearize` writes a tree depth first with the label on both brackets and one placeholder
`XX` per word (GAFL's form) or the word itself; `delinearize` reads whatever a model
emitted back into a well-formed tree over the sentence's words, counting the repairs it
made (or, with `repair=False`, refusing the first problem), so that every output line can
be scored by EVALB; `right_branching` is the baseline over the same words. The trees
themselves (reading, cleaning) are `aiayn.parsing.trees`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from aiayn.parsing.trees import PLACEHOLDER, PUNCTUATION_TAGS, ROOT_LABEL, MalformedTreeError, Tree


def linearize(tree: Tree, *, words: bool = False) -> str:
    """The GAFL target: `(S (NP XX XX )NP (VP XX )VP XX )S` (words become XX).

    With `words`, each word is written in place of its XX: `(S (NP the cat )NP ...)S`.
    The decoder then copies the source word by word, which ties each output position to
    a source position; with XX alone it has to count. A word that would read as a bracket
    token (one starting with '(' or ')') stays XX.
    """
    parts = []
    for kind, node in tree.events():
        if kind == "word":
            w = node.word
            parts.append(w if words and w is not None and w[0] not in "()" else PLACEHOLDER)
        elif kind == "open":
            parts.append(f"({node.label}")
        else:
            parts.append(f"){node.label}")
    return " ".join(parts)


def punctuation_tag(word: str) -> str:
    """The PTB tag of a punctuation word, from its form alone; PLACEHOLDER (XX) for any
    other word."""
    return PUNCTUATION_TAGS.get(word, PLACEHOLDER)


def punctuation_tags(words: Sequence[str]) -> list[str]:
    """`punctuation_tag` of each word, but `'` closing an open "`" is a quote (''), not
    the possessive: on the WSJ sample this is right for 72 of its 73 occurrences."""
    tags, quotes = [], 0
    for word in words:
        tag = punctuation_tag(word)
        if word == "`":
            quotes += 1
        elif word == "'" and quotes:
            tag, quotes = "''", quotes - 1
        tags.append(tag)
    return tags


@dataclass
class Repairs:
    """What `delinearize` changed to make a well-formed tree, by kind."""

    unclosed: int = 0  # '(' never closed: closed at the end
    unmatched_close: int = 0  # ')L' with nothing open: dropped
    mismatched_close: int = 0  # ')L' closing an '(M': closed, keeping M
    surplus_words: int = 0  # XX beyond the sentence's words: dropped
    missing_words: int = 0  # words without an XX: added at the end (see delinearize)
    unknown_tokens: int = 0  # a bare '(' or ')', or a label holding a bracket: dropped
    changed_words: int = 0  # a word written where another was due: the input's word kept
    empty_constituents: int = 0  # '(L ... )L' over no word: dropped
    root_added: int = 0  # not one constituent at the top: wrapped in ROOT_LABEL

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def well_formed(self) -> bool:
        return self.total == 0

    def __add__(self, other: Repairs) -> Repairs:
        return Repairs(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_dict(self) -> dict[str, int]:
        """Each kind's count, in the order above (for logs and manifests)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_label(text: str) -> bool:
    """Whether `text` can be a label: one with a bracket would not read back as a tree."""
    return "(" not in text and ")" not in text


class _Builder:
    """A tree under construction: the open constituents, the words still to place."""

    def __init__(self, words: Sequence[str], tags: Sequence[str], repair: bool) -> None:
        self.words, self.tags, self.repair = words, tags, repair
        self.next = 0  # index of the next word
        self.stack: list[tuple[str, list[Tree]]] = [("", [])]  # [0]: the top level
        self.repairs = Repairs()

    def fix(self, kind: str, problem: str, n: int = 1) -> None:
        if not self.repair:
            raise MalformedTreeError(problem)
        setattr(self.repairs, kind, getattr(self.repairs, kind) + n)

    def word(self) -> Tree:
        tree = Tree(self.tags[self.next], word=self.words[self.next])
        self.next += 1
        return tree

    def close(self) -> None:
        label, children = self.stack.pop()
        if children:
            self.stack[-1][1].append(Tree(label, children))
        else:
            self.fix("empty_constituents", f"empty constituent ({label} )")

    def token(self, tok: str, i: int) -> None:
        if tok == PLACEHOLDER or tok[0] not in "()":  # a word's place: XX, or the word
            if self.next >= len(self.words):
                self.fix("surplus_words", f"token {i}: {tok} beyond the {len(self.words)} words")
                return
            if tok != PLACEHOLDER and tok != self.words[self.next]:
                self.fix(
                    "changed_words",
                    f"token {i}: {tok!r} where word {self.next + 1} is {self.words[self.next]!r}",
                )
            self.stack[-1][1].append(self.word())
        elif tok[0] == "(" and len(tok) > 1 and _is_label(tok[1:]):
            self.stack.append((tok[1:], []))
        elif tok[0] == ")" and len(tok) > 1 and _is_label(tok[1:]):
            if len(self.stack) == 1:
                self.fix("unmatched_close", f"token {i}: {tok} closes nothing")
                return
            if tok[1:] != self.stack[-1][0]:
                self.fix("mismatched_close", f"token {i}: {tok} closes ({self.stack[-1][0]}")
            self.close()
        else:
            self.fix("unknown_tokens", f"token {i}: {tok!r} is not (LABEL, )LABEL, XX or a word")

    def finish(self) -> Tree:
        missing = len(self.words) - self.next
        if missing and len(self.stack) > 1:  # the lowest open constituent takes them
            self.fix("missing_words", f"{missing} of {len(self.words)} words have no XX", missing)
            self.stack[-1][1].extend(self.word() for _ in range(missing))
        if len(self.stack) > 1:
            self.fix("unclosed", f"{len(self.stack) - 1} '(' not closed", len(self.stack) - 1)
            while len(self.stack) > 1:
                self.close()
        top = self.stack[0][1]
        if len(top) == 1 and not top[0].is_preterminal:
            label, children = top[0].label, top[0].children
        else:
            self.fix("root_added", f"{len(top)} items at the top level, not one constituent")
            label, children = ROOT_LABEL, top
        missing = len(self.words) - self.next
        if missing:  # nothing was open: the root takes them
            self.fix("missing_words", f"{missing} of {len(self.words)} words have no XX", missing)
            children.extend(self.word() for _ in range(missing))
        return Tree(label, children)


def delinearize(
    text: str,
    words: Sequence[str],
    *,
    repair: bool = True,
    tags: Sequence[str] | None = None,
) -> tuple[Tree, Repairs]:
    """The tree a linearized sequence describes, over exactly `words` in order.

    A word's place is written XX (the GAFL scheme) or as the word itself (`linearize`'s
    `words`); either way the tree takes the input's word there, so both kinds of output
    read with no setting.

    With `repair`, any `text` gives a well-formed tree: tokens are read left to right and
    each problem is fixed as it is met (and counted in the Repairs): a word other than the
    one due is replaced by it; an unknown token, a surplus word or a close with nothing
    open is dropped; a close whose label differs from
    the open constituent's closes it, keeping the open label; a constituent over no word
    is dropped. At the end, words with no XX are attached to the lowest constituent still
    open, or if none is, appended to the root; open constituents are closed; and if the top
    level is not one constituent (several, a bare word, nothing) a ROOT_LABEL root holds it.

    Args:
        text: space-separated tokens `(L`, `)L` and `XX` or words (the model's output).
        words: the sentence (at least one word).
        repair: False raises MalformedTreeError at the first problem instead.
        tags: pre-terminal tags, one per word; default: `punctuation_tags(words)`, which
            is PLACEHOLDER for words that are not punctuation (EVALB's COLLINS.prm deletes
            punctuation by its tag, so the test tree must carry the gold tree's).

    Returns:
        (tree, repairs); `repairs.total` is 0 when `text` was well formed.
    """
    if not words:
        raise ValueError("delinearize needs at least one word")
    if tags is None:
        tags = punctuation_tags(words)
    elif len(tags) != len(words):
        raise ValueError(f"{len(tags)} tags for {len(words)} words")
    builder = _Builder(words, tags, repair)
    for i, tok in enumerate(text.split()):
        builder.token(tok, i)
    return builder.finish(), builder.repairs


def right_branching(words: Sequence[str], label: str = ROOT_LABEL) -> Tree:
    """The right-branching baseline: `(S (XX w1) (S (XX w2) ... (S (XX wn-1) (XX wn))))`,
    every constituent labelled `label`, words tagged as `delinearize` tags them."""
    if not words:
        raise ValueError("right_branching needs at least one word")
    leaves = [Tree(tag, word=w) for w, tag in zip(words, punctuation_tags(words), strict=True)]
    tree = Tree(label, [leaves[-1]]) if len(leaves) == 1 else Tree(label, leaves[-2:])
    for leaf in reversed(leaves[:-2]):
        tree = Tree(label, [leaf, tree])
    return tree
