"""Constituency trees for English constituency parsing (section 6.3): read Penn Treebank
brackets and clean them; `aiayn.parsing.linearize` turns them into the sequence a
Transformer learns and back.

The task follows Vinyals et al. (2015), "Grammar as a Foreign Language" (GAFL): the source
is the sentence's words, the target its tree linearized depth first, with the label on both
brackets and one placeholder `XX` per word (the words themselves are not in the target):

    (S (NP (DT the) (NN cat)) (VP (VBD sat)) (. .))  ->  (S (NP XX XX )NP (VP XX )VP XX )S

`linearize.delinearize` reads a decoded target back into a tree over the sentence's words:
whatever the model emitted, it returns a well-formed tree and counts the repairs it made.

A `Tree` is either a pre-terminal (a POS tag over one word: `word` is set, no children)
or a constituent with one child or more; no empty constituent is ever built.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
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
