"""Constituency trees for English constituency parsing (section 6.3): read Penn Treebank
brackets, clean them, and turn them into the sequence a Transformer learns and back.

The task follows Vinyals et al. (2015), "Grammar as a Foreign Language" (GAFL): the source
is the sentence's words, the target its tree linearized depth first, with the label on both
brackets and one placeholder `XX` per word (the words themselves are not in the target):

    (S (NP (DT the) (NN cat)) (VP (VBD sat)) (. .))  ->  (S (NP XX XX )NP (VP XX )VP XX )S

`delinearize` reads a decoded target back into a tree over the sentence's words: whatever
the model emitted, it returns a well-formed tree and counts the repairs it made (or, with
`repair=False`, refuses the first problem), so every output line can be scored by EVALB.

A `Tree` is either a pre-terminal (a POS tag over one word: `word` is set, no children)
or a constituent with one child or more; no empty constituent is ever built.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from aiayn.files import InputError, open_bytes

#: The placeholder for a word (a pre-terminal) in the linearized tree, and the tag
#: `delinearize` gives words that are not punctuation.
PLACEHOLDER = "XX"

#: Root labels of a wrapper over the real top constituent: the PTB's empty label
#: `( (S ...) )`, and the ROOT / TOP that other parsers (silver trees) write.
WRAPPER_LABELS = frozenset({"", "ROOT", "TOP"})

#: The root label used when a tree has no single top constituent: a wrapper over several
#: children or over a bare pre-terminal (`clean`), several top-level items or none in a
#: decoded sequence (`delinearize`), and every node of the right-branching baseline. S is
#: the commonest top constituent, and a label EVALB scores like any other.
ROOT_LABEL = "S"

#: Tags of punctuation by word form (the PTB's tagging guidelines, measured on the WSJ
#: sample: the module docstring of `aiayn.parsing` gives the agreement). `'` is tagged by
#: its majority, the possessive POS; in a sentence, `punctuation_tags` makes it a closing
#: quote after an unmatched "`".
PUNCTUATION_TAGS: dict[str, str] = {
    ",": ",",
    ".": ".",
    "?": ".",
    "!": ".",
    ":": ":",
    ";": ":",
    "--": ":",
    "-": ":",
    "...": ":",
    "``": "``",
    "`": "``",
    "''": "''",
    "'": "POS",
    "-LRB-": "-LRB-",
    "-LCB-": "-LRB-",
    "-RRB-": "-RRB-",
    "-RCB-": "-RRB-",
    "$": "$",
    "US$": "$",
    "C$": "$",
    "A$": "$",
    "HK$": "$",
    "NZ$": "$",
    "#": "#",
}


class MalformedTreeError(ValueError):
    """A linearized tree that is not well formed (strict `delinearize`); says what is wrong."""


@dataclass(eq=False, repr=False)
class Tree:
    """A constituent `label` over `children`, or a pre-terminal: the tag `label` over `word`."""

    label: str
    children: list[Tree] = field(default_factory=list)
    word: str | None = None

    def __post_init__(self) -> None:
        if (self.word is None) == (not self.children):
            raise ValueError(
                f"({self.label} ...): a Tree has a word or children, not both or neither"
            )

    @property
    def is_preterminal(self) -> bool:
        return self.word is not None

    def events(self) -> Iterator[tuple[str, Tree]]:
        """("open", node), ("word", pre-terminal) and ("close", node) in depth-first order:
        every walk below uses it, so no tree is too deep for Python's recursion limit."""
        stack: list[tuple[Tree, bool]] = [(self, False)]
        while stack:
            node, closing = stack.pop()
            if closing:
                yield "close", node
            elif node.word is not None:
                yield "word", node
            else:
                yield "open", node
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(node.children))

    def preterminals(self) -> list[Tree]:
        return [node for kind, node in self.events() if kind == "word"]

    def leaves(self) -> list[str]:
        return [str(node.word) for node in self.preterminals()]

    def pos_tags(self) -> list[str]:
        return [node.label for node in self.preterminals()]

    def constituents(self) -> int:
        """Number of constituents, pre-terminals not counted (EVALB's brackets)."""
        return sum(kind == "open" for kind, _ in self.events())

    def to_string(self) -> str:
        """One line of PTB brackets: `(S (NP (DT the) (NN cat)) (VP (VBD sat)))`."""
        parts = []
        for kind, node in self.events():
            if kind == "word":
                parts.append(f"({node.label} {node.word})")
            elif kind == "open":
                parts.append(f"({node.label}")
            else:
                parts[-1] += ")"
        return " ".join(parts)

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        return f"<Tree {self.to_string()}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tree):
            return NotImplemented
        return _shape(self) == _shape(other)


def _shape(tree: Tree) -> list[tuple[str, str, str | None]]:
    return [(kind, node.label, node.word) for kind, node in tree.events()]


# --------------------------------------------------------------------------- reading brackets
def _tokens(text: str) -> list[tuple[str, int]]:
    """Brackets and atoms of `text`, each with the number of its line (0 for the first)."""
    return [
        (tok, k)
        for k, line in enumerate(text.split("\n"))
        for tok in line.replace("(", " ( ").replace(")", " ) ").split()
    ]


def _error(where: str, k: int, problem: str) -> InputError:
    """`problem` at `where` ("path:line"), naming the line too when it is not the first."""
    m = re.fullmatch(r"(.*):(\d+)", where)
    if k and m:
        where = f"{where} (at line {int(m.group(2)) + k})"
    return InputError(f"{where}: {problem}")


@dataclass
class _Open:
    label: str
    line: int
    children: list[Tree] = field(default_factory=list)
    word: str | None = None


def _parse(tokens: Sequence[tuple[str, int]], where: str) -> Tree:
    """Exactly one tree from `tokens`; an InputError naming `where` and the problem."""
    if not tokens:
        raise InputError(f"{where}: no tree (empty text)")
    stack: list[_Open] = []
    root: Tree | None = None
    i = 0
    while i < len(tokens):
        tok, k = tokens[i]
        if root is not None:
            raise _error(where, k, f"trailing text after the tree: {tok!r}")
        if tok == "(":
            label = tokens[i + 1][0] if i + 1 < len(tokens) else "("
            if label in "()":
                if stack:
                    raise _error(where, k, f"label missing after '(' inside ({stack[-1].label} ...")
                label = ""  # the PTB's wrapper `( (S ...) )`
            else:
                i += 1
            stack.append(_Open(label, k))
        elif tok == ")":
            if not stack:
                raise _error(where, k, "unbalanced bracket: ')' closes nothing")
            node = stack.pop()
            if not node.children and node.word is None:
                raise _error(where, k, f"empty constituent ({node.label}) with no word or child")
            tree = Tree(node.label, node.children, node.word)
            if not stack:
                root = tree
            elif stack[-1].word is not None:
                raise _error(
                    where,
                    k,
                    f"a word outside a pre-terminal: ({stack[-1].label} "
                    f"{stack[-1].word} ...) holds both a word and a constituent",
                )
            else:
                stack[-1].children.append(tree)
        elif not stack:
            raise _error(where, k, f"text outside the tree: {tok!r} (expected '(')")
        elif stack[-1].children or stack[-1].word is not None:
            raise _error(
                where, k, f"a word outside a pre-terminal: {tok!r} in ({stack[-1].label} ...)"
            )
        else:
            stack[-1].word = tok
        i += 1
    if stack:
        raise _error(
            where,
            stack[0].line,
            f"unbalanced bracket: {len(stack)} '(' not closed (innermost: ({stack[-1].label} ...)",
        )
    assert root is not None
    return root


def parse_tree(text: str, where: str = "<string>") -> Tree:
    """One tree in PTB brackets, over any number of lines; the PTB's outer wrapper
    `( (S ...) )` is read as a root with the empty label (`clean` removes it).

    Raises:
        InputError: naming `where` (e.g. "path:line") and what is wrong.
    """
    return _parse(_tokens(text), where)


def decode_lines(raw_lines: Iterable[bytes], name: str) -> Iterator[str]:
    """Text lines from byte lines (split on b"\\n", as `aiayn.files.read_lines` does):
    invalid UTF-8 is an InputError naming `name`, the line and the byte."""
    for lineno, raw in enumerate(raw_lines, start=1):
        raw = raw.removesuffix(b"\n")
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"{name}:{lineno}: invalid UTF-8 at byte {e.start} of the line "
                f"({raw[e.start : e.start + 4]!r})"
            ) from None


def _stream_lines(path: str | Path) -> Iterator[str]:
    """The lines of a plain or gzip file, read as they come (silver sets are large)."""
    with open_bytes(path) as f:
        yield from decode_lines(f, str(path))


def trees_from_lines(lines: Iterable[str], name: str) -> Iterator[tuple[int, Tree]]:
    """(line a tree starts on, tree) for the multi-line trees of `lines`: a tree ends
    where its brackets balance. Errors name `name` and the line the bad tree starts on."""
    tokens: list[tuple[str, int]] = []
    depth, start = 0, 0
    for lineno, line in enumerate(lines, start=1):
        for tok, _ in _tokens(line):
            if depth == 0:
                if tok != "(":
                    what = "')' closes nothing" if tok == ")" else f"text outside a tree: {tok!r}"
                    raise InputError(f"{name}:{lineno}: {what}")
                start, tokens = lineno, []
            tokens.append((tok, lineno - start))
            depth += 1 if tok == "(" else -1 if tok == ")" else 0
            if depth == 0:
                yield start, _parse(tokens, f"{name}:{start}")
    if depth:
        raise InputError(
            f"{name}:{start}: unbalanced bracket: the tree starting here has {depth} '(' "
            "not closed at the end of the file"
        )


def read_trees(path: str | Path) -> Iterator[tuple[int, Tree]]:
    """(line, tree) for each tree of a .mrg file (trees span several lines)."""
    return trees_from_lines(_stream_lines(path), str(path))


def read_tree_lines(path: str | Path) -> Iterator[tuple[int, Tree]]:
    """(line, tree) for a file of one tree per line (the prepared `.trees` files); an empty
    line, or one that is not exactly one tree, is an InputError naming FILE:LINE."""
    for lineno, line in enumerate(_stream_lines(path), start=1):
        if not line.strip():
            raise InputError(f"{path}:{lineno}: empty line where a tree was expected")
        yield lineno, parse_tree(line, f"{path}:{lineno}")


# --------------------------------------------------------------------------- cleaning
def clean_label(label: str) -> str:
    """`NP-SBJ-1` -> `NP`, `PP-LOC=2` -> `PP`, `ADVP|PRT` -> `ADVP`; a label starting with
    '-' (`-NONE-`, `-LRB-`, `-RRB-`) is a name, not a tag, and is kept."""
    if label.startswith("-"):
        return label
    return re.split(r"[-=|]", label, maxsplit=1)[0] or label


def clean(tree: Tree) -> Tree | None:
    """The standard preprocessing of a treebank tree; None if no word is left.

    - `-NONE-` pre-terminals (traces, null elements) are dropped, and so is every
      constituent left empty by that: `(S (NP-SBJ (-NONE- *-1)) (VP ...))` loses its NP.
    - Function tags and indices are stripped from labels (`clean_label`).
    - Punctuation is kept (EVALB's COLLINS.prm deletes it when scoring).
    - The wrapper (`( (S ...) )`, ROOT, TOP) is removed: the tree is rooted at its top
      constituent. A wrapper over several constituents, or over a bare pre-terminal, becomes
      a ROOT_LABEL (S) constituent.
    - Unary chains, `(NP (NP ...))` included, are kept: they are brackets EVALB scores.
    """
    kept: list[list[Tree]] = [[]]
    for kind, node in tree.events():
        if kind == "open":
            kept.append([])
        elif kind == "word":
            if node.label != "-NONE-":
                kept[-1].append(Tree(clean_label(node.label), word=node.word))
        else:
            children = kept.pop()
            if children:
                kept[-1].append(Tree(clean_label(node.label), children))
    if not kept[0]:
        return None
    top = kept[0][0]
    if tree.word is None and tree.label in WRAPPER_LABELS:
        top = Tree(ROOT_LABEL, top.children)  # the wrapper's label was cleaned: replace it
        if len(top.children) == 1 and not top.children[0].is_preterminal:
            top = top.children[0]
    elif top.is_preterminal:
        top = Tree(ROOT_LABEL, [top])
    return top


# --------------------------------------------------------------------------- linearization
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
