"""A treebank PCFG with CKY decoding: the baseline a parsing reader expects beside section
6.3's parser (Klein and Manning, 2003, "Accurate Unlexicalized Parsing": vertical order 2,
horizontal order 2).

Counted from the training trees (`Pcfg.train`), in four steps:

1. **Parent annotation** (vertical Markovization, order 2): each phrasal label gets its
   parent's, `NP` under `S` becomes `NP^S` (tags stay plain); `parent=False` skips it.
2. **Binarization with horizontal Markovization** (order `h`, default 2): `A -> X1 X2 ...
   Xn` becomes `A -> X1 @A|X1`, `@A|X1 -> X2 @A|X2`, ..., `@A|Xn-2 -> Xn-1 Xn`, each
   intermediate symbol remembering the last `h` siblings written.
3. **Relative frequencies**: P(A -> B C), P(A -> B) (unary chains, kept as the treebank has
   them, and over tags), P(word | tag); a word seen fewer than `rare` times shares the
   counts of its signature (capitalised, digits, hyphen, suffix: `signature`), as does any
   unseen word.
4. **CKY** (`Pcfg.parse`): the Viterbi tree over the words, vectorized with numpy (for each
   span, every binary rule whose children are both reachable, over all split points at
   once; then unary closure), undone to the treebank's form (no @ symbols, no ^ parents).

Tags: the tree's pre-terminals are the PCFG's own tags, except punctuation, tagged by form
(`linearize.punctuation_tags`) as the Transformer's trees are, so EVALB deletes the same words
in both. A sentence with no parse (every word's tags unreachable from the root: rare) gets
the right-branching tree and is counted (`Pcfg.failures`).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from aiayn.parsing.linearize import punctuation_tags, right_branching
from aiayn.parsing.trees import Tree

#: The root symbol of every training tree and of every parse.
ROOT = "TOP"
#: The lexicon's entry for all rare words together (no word or signature looks like it).
UNKNOWN = "<rare>"


def signature(word: str) -> str:
    """The class of a rare or unseen word, from its form (Petrov's simple unknown-word
    classes): capitalisation, digits, hyphens and a common suffix."""
    parts = ["UNK"]
    if word[:1].isupper():
        parts.append("C")
    elif word.lower() != word:
        parts.append("c")
    if any(ch.isdigit() for ch in word):
        parts.append("D")
    if "-" in word:
        parts.append("H")
    low = word.lower()
    for suffix in ("ing", "ed", "ly", "ion", "er", "est", "al", "ity", "s"):
        if low.endswith(suffix) and len(low) > len(suffix) + 2:
            parts.append(suffix)
            break
    return "-".join(parts)


def _annotate(tree: Tree, parent: bool) -> Tree:
    """Parent annotation of the phrasal labels (not of tags), under a TOP root."""

    def walk(node: Tree, up: str) -> Tree:
        if node.word is not None:
            return node
        label = f"{node.label}^{up}" if parent else node.label
        return Tree(label, [walk(c, node.label) for c in node.children])

    return Tree(ROOT, [walk(tree, ROOT)])


def _rules(tree: Tree, h: int) -> Iterable[tuple[str, tuple[str, ...]]]:
    """(lhs, rhs) of every binarized rule of an annotated tree; rhs of one symbol is a
    unary rule, and a pre-terminal gives (tag, (word,)) with a word marked by a leading
    space (no label starts with one)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if node.word is not None:
            yield node.label, (" " + node.word,)
            continue
        kids = [c.label for c in node.children]
        stack.extend(node.children)
        if len(kids) <= 2:
            yield node.label, tuple(kids)
            continue
        lhs = node.label
        for i in range(len(kids) - 2):
            base = node.label.lstrip("@").split("|")[0]
            inter = f"@{base}|" + "_".join(kids[max(0, i + 1 - h) : i + 1])
            yield lhs, (kids[i], inter)
            lhs = inter
        yield lhs, (kids[-2], kids[-1])


def _undo(tree: Tree) -> Tree:
    """The treebank's tree from a parse: @ symbols spliced into their parents, ^ parents
    cut, the TOP root removed."""

    def walk(node: Tree) -> list[Tree]:
        if node.word is not None:
            return [node]
        kids = [k for c in node.children for k in walk(c)]
        if node.label.startswith("@"):
            return kids
        return [Tree(node.label.split("^")[0], kids)]

    top = walk(tree)[0]
    if top.label == ROOT:
        top = top.children[0] if len(top.children) == 1 else Tree("S", top.children)
    return top


class Pcfg:
    """A PCFG counted from trees (see the module docstring); `parse` gives Viterbi trees."""

    def __init__(self, parent: bool = True, h: int = 2, rare: int = 2) -> None:
        self.parent, self.h, self.rare = parent, h, rare
        self.failures = 0

    # ------------------------------------------------------------------ counting
    def train(self, trees: Iterable[Tree]) -> Pcfg:
        binary: Counter[tuple[str, str, str]] = Counter()
        unary: Counter[tuple[str, str]] = Counter()
        lex: Counter[tuple[str, str]] = Counter()
        lhs_count: Counter[str] = Counter()
        for tree in trees:
            for lhs, rhs in _rules(_annotate(tree, self.parent), self.h):
                lhs_count[lhs] += 1
                if rhs[0].startswith(" "):
                    lex[(lhs, rhs[0][1:])] += 1
                elif len(rhs) == 1:
                    unary[(lhs, rhs[0])] += 1
                else:
                    binary[(lhs, rhs[0], rhs[1])] += 1
        words = Counter(w for (_, w) in lex.elements())
        symbols = sorted(
            lhs_count.keys() | {s for r in binary for s in r[1:]} | {c for _, c in unary}
        )
        self.symbols = symbols
        self.index = {s: i for i, s in enumerate(symbols)}
        tags = sorted({t for t, _ in lex})
        self.tags = [self.index[t] for t in tags]
        tag_total = Counter({t: sum(c for (tt, _), c in lex.items() if tt == t) for t in tags})
        # lexicon: P(word | tag) for words seen `rare` times or more; the rest by signature
        self.lexicon: dict[str, dict[int, float]] = defaultdict(dict)
        for (t, w), c in lex.items():
            # a rare word counts for its signature and for the class of all rare words,
            # which an unseen word with an unseen signature falls back to
            keys = [w] if words[w] >= self.rare else [signature(w), UNKNOWN]
            for key in keys:
                d = self.lexicon[key]
                d[self.index[t]] = d.get(self.index[t], 0.0) + c
        for d in self.lexicon.values():
            for tag in list(d):
                d[tag] = math.log(d[tag] / tag_total[self.symbols[tag]])
        self.known = {w for w, c in words.items() if c >= self.rare}
        order = sorted(binary, key=lambda r: self.index[r[0]])
        self.b_lhs = np.array([self.index[a] for a, _, _ in order], dtype=np.int64)
        self.b_left = np.array([self.index[b] for _, b, _ in order], dtype=np.int64)
        self.b_right = np.array([self.index[c] for _, _, c in order], dtype=np.int64)
        self.b_logp = np.array(
            [math.log(binary[r] / lhs_count[r[0]]) for r in order], dtype=np.float64
        )
        self.u_lhs = np.array([self.index[a] for a, _ in unary], dtype=np.int64)
        self.u_child = np.array([self.index[b] for _, b in unary], dtype=np.int64)
        self.u_logp = np.array(
            [math.log(c / lhs_count[a]) for (a, _), c in unary.items()], dtype=np.float64
        )
        self.rule_logp: dict[tuple[str, tuple[str, ...]], float] = {}
        for (lhs, left, right), n in binary.items():
            self.rule_logp[(lhs, (left, right))] = math.log(n / lhs_count[lhs])
        for (lhs, child), n in unary.items():
            self.rule_logp[(lhs, (child,))] = math.log(n / lhs_count[lhs])
        return self

    def word_scores(self, word: str) -> dict[int, float]:
        """log P(word | tag) for each tag that can write `word`."""
        if word in self.known:
            return self.lexicon[word]
        return (
            self.lexicon.get(signature(word))
            or self.lexicon.get(UNKNOWN)
            or {t: math.log(1e-6) for t in self.tags}
        )

    def tree_log_prob(self, tree: Tree) -> float:
        """log P of a (cleaned) tree under the grammar: the sum over its binarized rules
        and words; -inf if it uses a rule the grammar lacks."""
        total = 0.0
        for lhs, rhs in _rules(_annotate(tree, self.parent), self.h):
            if rhs[0].startswith(" "):
                total += self.word_scores(rhs[0][1:]).get(self.index.get(lhs, -1), -math.inf)
            else:
                total += self.rule_logp.get((lhs, rhs), -math.inf)
        return total

    # ------------------------------------------------------------------ CKY
    def _unary_closure(self, cell: np.ndarray, back: dict[int, tuple]) -> None:
        for _ in range(4):  # unary chains in the treebank are at most a few long
            cand = cell[self.u_child] + self.u_logp
            better = cand > cell[self.u_lhs] + 1e-12
            if not better.any():
                return
            idx = np.flatnonzero(better)
            # several rules may improve one lhs: keep the best of them
            order = idx[np.argsort(-cand[idx], kind="stable")]
            seen = set()
            for r in order.tolist():
                a = int(self.u_lhs[r])
                if a in seen:
                    continue
                seen.add(a)
                cell[a] = cand[r]
                back[a] = ("u", int(self.u_child[r]))

    def parse_with_score(self, words: Sequence[str]) -> tuple[Tree, float]:
        """The Viterbi tree over `words` and its log-probability (-inf: no parse; the tree
        is then right-branching)."""
        n, s = len(words), len(self.symbols)
        if n == 0:
            raise ValueError("a parse needs at least one word")
        chart = np.full((n, n + 1, s), -np.inf)
        back: list[list[dict[int, tuple]]] = [[{} for _ in range(n + 1)] for _ in range(n)]
        for i, w in enumerate(words):
            for t, lp in self.word_scores(w).items():
                chart[i, i + 1, t] = lp
                back[i][i + 1][t] = ("w", i)
            self._unary_closure(chart[i, i + 1], back[i][i + 1])
        finite = np.isfinite(chart)
        for width in range(2, n + 1):
            for i in range(n - width + 1):
                j = i + width
                ks = np.arange(i + 1, j)
                left_any = finite[i, ks].any(axis=0)
                right_any = finite[ks, j].any(axis=0)
                active = np.flatnonzero(left_any[self.b_left] & right_any[self.b_right])
                if active.size == 0:
                    continue
                cand = (
                    chart[i, ks][:, self.b_left[active]]
                    + chart[ks, j][:, self.b_right[active]]
                    + self.b_logp[active]
                )  # (splits, rules)
                split = cand.argmax(axis=0)
                best = cand[split, np.arange(active.size)]
                lhs = self.b_lhs[active]  # sorted: rules are ordered by lhs
                starts = np.flatnonzero(np.r_[True, lhs[1:] != lhs[:-1]])
                top = np.maximum.reduceat(best, starts)
                cell = chart[i, j]
                # the first rule reaching each lhs's maximum
                hit = np.flatnonzero(best == np.repeat(top, np.diff(np.r_[starts, lhs.size])))
                _, first = np.unique(lhs[hit], return_index=True)
                for r in hit[first].tolist():
                    a = int(lhs[r])
                    if math.isfinite(best[r]):
                        cell[a] = best[r]
                        rule = int(active[r])
                        back[i][j][a] = ("b", rule, int(ks[split[r]]))
                self._unary_closure(cell, back[i][j])
                finite[i, j] = np.isfinite(cell)
        root = self.index[ROOT]
        score = float(chart[0, n, root])
        if not math.isfinite(score):
            self.failures += 1
            return right_branching(words), -math.inf
        parsed = _undo(self._build(back, 0, n, root, words))
        for leaf, tag in zip(parsed.preterminals(), punctuation_tags(words), strict=True):
            if tag != "XX":
                leaf.label = tag
        return parsed, score

    def parse(self, words: Sequence[str]) -> Tree:
        return self.parse_with_score(words)[0]

    def _build(
        self, back: list[list[dict[int, tuple]]], i: int, j: int, a: int, words: Sequence[str]
    ) -> Tree:
        entry = back[i][j][a]
        label = self.symbols[a]
        if entry[0] == "w":
            return Tree(label, word=words[entry[1]])
        if entry[0] == "u":
            child = self._build(back, i, j, entry[1], words)
            return Tree(label, [child])
        _, rule, k = entry
        left = self._build(back, i, k, int(self.b_left[rule]), words)
        right = self._build(back, k, j, int(self.b_right[rule]), words)
        return Tree(label, [left, right])
