"""Constituency-parsing scores exactly as EVALB computes them (Sekine & Collins 1997,
with Ellis's 2006 bug fix): the scorer every parsing paper reports, in pure Python.

Published parsing F1 is "what evalb prints with COLLINS.prm". A home-made bracket scorer
differs from it in small ways that move F1 by tenths (which labels are deleted, how
"NP-SBJ-1" is cut, how duplicate brackets match, which sentences are dropped), so this
module copies evalb.c statement by statement instead of re-deriving the metric, and its
tests compare the printed report with the real binary's, character for character.

What evalb does, and therefore what this does (see the tests for each case):

- One tree per line, read as bytes. A leaf is "(TAG word)"; anything else opens a
  bracket. "( (S ...) )" (the PTB's root) is a bracket with the empty label, and it is
  scored like any other. Lines longer than evalb's 5000-byte buffer are split where its
  `fgets` splits them (the pieces become separate "sentences").
- DELETE_LABEL: a leaf with that exact tag is dropped, word and all (so punctuation does
  not count as a word); a bracket whose label (after cutting, below; EQ_LABEL applies)
  is one is dropped but its children stay. A bracket left spanning no word is dropped.
- Labels are cut at their first "-" or "=": NP-SBJ-1 and NP=2 are NP, but -NONE- and
  -LRB- as bracket labels become the empty label. Tags of leaves are never cut.
- Sentence length (the CUTOFF_LEN split) is the gold tree's number of leaves whose tag is
  not a DELETE_LABEL_FOR_LENGTH one: deleted punctuation counts, traces do not.
- If the test tree has no words left: status 2 (skipped). If the word counts differ after
  deletion, quote leaves listed in QUOTE_LABEL that one side deleted and the other kept
  are put back (Ellis's fix); if they still differ, or a word differs: status 1 (error).
  Skipped and error sentences are left out of every total, and every error counts
  towards MAX_ERROR: at the (MAX_ERROR + 2)-th error evalb stops without a summary
  (here: `EvalbAbortError`). So does any text that is not a bracket, a tag or a word (a
  word outside "(TAG word)", a leaf like "(NN a )" with a space before ")").
- Unbalanced brackets are an error (status 1) too, but the sentence is still scored and
  its line printed with its numbers; a ")" with nothing open closes bracket 0 again.
- Brackets match greedily: each gold bracket takes the first unmatched test bracket
  with the same span and (with LABELED 1) an equal label; so n gold and m test copies of
  one bracket give min(n, m) matches. Crossing brackets are test brackets that cross
  some gold bracket. Tags compare leaf by leaf (EQ_LABEL applies).
- Percentages are 0 when their denominator is 0; F-measure is 2PR/(P+R), which evalb
  prints as "-nan" when P + R = 0 (`EvalbSummary.f1` is 0.0 then).

Where evalb.c's behaviour is undefined (more than 200 words or brackets in a sentence,
words over 99 or labels over 29 bytes, more than 20 quote leaves, more than four
surplus ")"), it overruns its fixed arrays; here those inputs are scored as the same
code would score them with unbounded arrays. `DEBUG` is read but evalb's debug dumps
are not reproduced. Two deliberate differences: files are read with
aiayn.files.read_lines, so a UTF-8 byte-order mark is dropped (evalb cannot read such a
first line and stops), and gold and test files with different line counts are refused
(evalb scores the common part and reports one error).

Long because it is one port: evalb.c's reading, label rules, bracket matching and report,
in evalb.c's order so that the two read side by side; split, each part would serve only
the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiayn.files import InputError, read_lines

#: C's isspace() in the "C" locale (evalb never calls setlocale).
_SPACE = frozenset(b" \t\n\v\f\r")
#: evalb's is_terminator(): the characters that end a label or a word.
_TERMINATOR = _SPACE | frozenset(b"()")
#: evalb reads each file with fgets(buff, 5000, fd): at most 4999 bytes at a time.
_FGETS_BYTES = 4999
#: More repeated "Reading sentence" errors than this are not listed one by one.
_MAX_REPEATED_MESSAGES = 1_000_000

HEADER = (
    "  Sent.                        Matched  Bracket   Cross        Correct Tag\n"
    " ID  Len.  Stat. Recal  Prec.  Bracket gold test Bracket Words  Tags Accracy\n"
    "============================================================================\n"
)
_RULE = "============================================================================\n"


# --------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class EvalbParams:
    """The settings of an EVALB parameter (.prm) file.

    Each field is the evalb.c variable of the same meaning; labels are compared as exact
    byte strings (UTF-8 here), as evalb compares them with strcmp.
    """

    debug: int = 0
    #: evalb stops at the (max_error + 2)-th error (its test is `Error_count++ > MAX_ERROR`).
    max_error: int = 10
    #: The second summary is over sentences of at most this many (gold) words.
    cutoff_len: int = 40
    #: False: a bracket matches on its span alone.
    labeled: bool = True
    delete_labels: tuple[str, ...] = ()
    delete_labels_for_length: tuple[str, ...] = ()
    #: Tags whose leaf, if its word is ', " or /, may be put back by the 2006 fix.
    quote_labels: tuple[str, ...] = ()
    #: Pairs of labels counted as equal, both ways (not transitively).
    eq_labels: tuple[tuple[str, str], ...] = ()
    #: Pairs of words counted as equal, both ways.
    eq_words: tuple[tuple[str, str], ...] = ()


#: COLLINS.prm, the settings of (Collins 1997) that parsing papers report with.
COLLINS = EvalbParams(
    debug=0,
    max_error=10,
    cutoff_len=40,
    labeled=True,
    delete_labels=("TOP", "-NONE-", ",", ":", "``", "''", "."),
    delete_labels_for_length=("-NONE-",),
    eq_labels=(("ADVP", "PRT"),),
)


def _atoi(text: str) -> int:
    """C's atoi(): leading blanks, a sign, then digits; 0 if there are none."""
    s = text.lstrip(" \t\n\v\f\r")
    sign = 1
    if s[:1] in ("+", "-"):
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    digits = ""
    for ch in s:
        if not "0" <= ch <= "9":
            break
        digits += ch
    return sign * int(digits) if digits else 0


def parse_params(lines: Iterable[str], source: str = "<params>") -> EvalbParams:
    """EvalbParams from the lines of a .prm file, read as evalb's read_parameter_file does.

    Lines starting with "#" or shorter than 3 characters are ignored; a line is a keyword,
    blanks, then its value (the rest of the line, trailing blanks removed). Numbers are
    read with C's atoi. Where evalb only warns on stderr and goes on (an unknown keyword,
    a keyword without a value, EQ_LABEL or EQ_WORD without exactly two values) this
    raises InputError naming SOURCE:LINE, since a misspelt DELETE_LABEL that is silently
    ignored changes every score.
    """
    values: dict[str, int] = {}
    lists: dict[str, list[str]] = {"DELETE_LABEL": [], "DELETE_LABEL_FOR_LENGTH": []}
    lists["QUOTE_LABEL"] = []
    pairs: dict[str, list[tuple[str, str]]] = {"EQ_LABEL": [], "EQ_WORD": []}
    for lineno, raw in enumerate(lines, start=1):
        line = raw[:1] + raw[1:].rstrip(" \t\n\v\f\r")
        if line.startswith("#") or len(line) < 3:
            continue
        i = 0
        while i < len(line) and line[i] not in " \t\n\v\f\r":
            i += 1
        key = line[:i]
        value = line[i:].lstrip(" \t\n\v\f\r")
        where = f"{source}:{lineno}"
        if key not in ("DEBUG", "MAX_ERROR", "CUTOFF_LEN", "LABELED", *lists, *pairs):
            raise InputError(f"{where}: unknown keyword {key!r} (evalb would ignore the line)")
        if not value:
            raise InputError(f"{where}: {key} has no value")
        if key in lists:
            lists[key].append(value)
        elif key in pairs:
            parts = value.split()
            if len(parts) != 2:
                raise InputError(f"{where}: {key} requires two values, got {value!r}")
            pairs[key].append((parts[0], parts[1]))
        else:
            values[key] = _atoi(value)
    return EvalbParams(
        debug=values.get("DEBUG", 0),
        max_error=values.get("MAX_ERROR", 10),
        cutoff_len=values.get("CUTOFF_LEN", 40),
        labeled=values.get("LABELED", 1) != 0,
        delete_labels=tuple(lists["DELETE_LABEL"]),
        delete_labels_for_length=tuple(lists["DELETE_LABEL_FOR_LENGTH"]),
        quote_labels=tuple(lists["QUOTE_LABEL"]),
        eq_labels=tuple(pairs["EQ_LABEL"]),
        eq_words=tuple(pairs["EQ_WORD"]),
    )


def load_params(path: str | Path) -> EvalbParams:
    """EvalbParams from an EVALB .prm file (COLLINS.prm, new.prm, ...); see parse_params."""
    return parse_params(read_lines(path), str(path))


def format_params(params: EvalbParams) -> str:
    """A .prm file with these settings, for running the real evalb with them."""
    lines = [
        f"DEBUG {params.debug}",
        f"MAX_ERROR {params.max_error}",
        f"CUTOFF_LEN {params.cutoff_len}",
        f"LABELED {int(params.labeled)}",
        *(f"DELETE_LABEL {x}" for x in params.delete_labels),
        *(f"DELETE_LABEL_FOR_LENGTH {x}" for x in params.delete_labels_for_length),
        *(f"QUOTE_LABEL {x}" for x in params.quote_labels),
        *(f"EQ_LABEL {a} {b}" for a, b in params.eq_labels),
        *(f"EQ_WORD {a} {b}" for a, b in params.eq_words),
    ]
    return "".join(line + "\n" for line in lines)


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class EvalbSentence:
    """One line of evalb's per-sentence table.

    `status`: 0 scored, 1 error (length or word mismatch, unbalanced brackets), 2 skipped
    (no words in the test tree). Error and skipped lines print zeros, except `length`,
    and are left out of every total. Percentages are as evalb computes them (0.0 when
    the denominator is 0), unrounded.
    """

    id: int
    length: int
    status: int
    recall: float
    precision: float
    matched_brackets: int
    gold_brackets: int
    test_brackets: int
    crossing: int
    words: int
    correct_tags: int
    tag_accuracy: float
    #: evalb's stderr lines for this sentence ("12 : Length unmatch (4|5)").
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvalbSummary:
    """One block of evalb's "=== Summary ===": over all sentences, or over those of at
    most `max_length` gold words. Percentages are unrounded (evalb prints them %6.2f)."""

    max_length: int | None
    sentences: int
    error_sentences: int
    skipped_sentences: int
    valid_sentences: int
    matched_brackets: int
    gold_brackets: int
    test_brackets: int
    recall: float
    precision: float
    #: 2PR/(P+R); 0.0 where P + R = 0 (evalb prints "-nan" there, see `f1_is_nan`).
    f1: float
    f1_is_nan: bool
    complete_match_sentences: int
    complete_match: float
    crossing: int
    average_crossing: float
    no_crossing_sentences: int
    no_crossing: float
    two_or_less_crossing_sentences: int
    two_or_less_crossing: float
    words: int
    correct_tags: int
    tagging_accuracy: float


@dataclass(frozen=True)
class EvalbResult:
    """Everything evalb reports for a gold file and a test file."""

    sentences: list[EvalbSentence]
    all: EvalbSummary
    #: The same over sentences of at most `cutoff_len` gold words ("-- len<=40 --").
    cutoff: EvalbSummary
    cutoff_len: int
    #: evalb's stderr lines, in order ("LINE : message").
    messages: list[str] = field(default_factory=list)
    #: True when evalb stopped (too many errors) before its summary; see EvalbAbortError.
    aborted: bool = False
    #: The real evalb's stdout, when the result comes from run_evalb.
    evalb_stdout: str | None = None

    @property
    def report(self) -> str:
        """evalb's report: the real evalb's stdout when run_evalb made this result, else
        format_report(self), the same text."""
        return self.evalb_stdout if self.evalb_stdout is not None else format_report(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (no NaN: see EvalbSummary.f1); the report text left out."""
        d = asdict(self)
        del d["evalb_stdout"]
        return d


class EvalbAbortError(InputError):
    """evalb stopped before its summary: more than MAX_ERROR + 1 errors, or a line that
    it cannot read at all. `result` holds the sentences scored before (aborted=True)."""

    def __init__(self, message: str, result: EvalbResult) -> None:
        super().__init__(message)
        self.result = result


def _percent(num: int, den: int) -> float:
    return 100.0 * num / den if den > 0 else 0.0


def summarize(sentences: Sequence[EvalbSentence], max_length: int | None = None) -> EvalbSummary:
    """evalb's totals (individual_result and print_total) over `sentences`, or over those
    of at most `max_length` gold words."""
    picked = [s for s in sentences if max_length is None or s.length <= max_length]
    valid = [s for s in picked if s.status not in (1, 2)]
    n_valid = len(valid)
    gold = sum(s.gold_brackets for s in valid)
    test = sum(s.test_brackets for s in valid)
    match = sum(s.matched_brackets for s in valid)
    crossing = sum(s.crossing for s in valid)
    words = sum(s.words for s in valid)
    tags = sum(s.correct_tags for s in valid)
    complete = sum(1 for s in valid if s.gold_brackets == s.test_brackets == s.matched_brackets)
    no_crossing = sum(1 for s in valid if s.crossing == 0)
    two_or_less = sum(1 for s in valid if s.crossing <= 2)
    r = _percent(match, gold)
    p = _percent(match, test)
    nan = p + r == 0.0
    return EvalbSummary(
        max_length=max_length,
        sentences=len(picked),
        error_sentences=sum(1 for s in picked if s.status == 1),
        skipped_sentences=sum(1 for s in picked if s.status == 2),
        valid_sentences=n_valid,
        matched_brackets=match,
        gold_brackets=gold,
        test_brackets=test,
        recall=r,
        precision=p,
        f1=0.0 if nan else 2 * p * r / (p + r),
        f1_is_nan=nan,
        complete_match_sentences=complete,
        complete_match=_percent(complete, n_valid),
        crossing=crossing,
        average_crossing=1.0 * crossing / n_valid if n_valid > 0 else 0.0,
        no_crossing_sentences=no_crossing,
        no_crossing=_percent(no_crossing, n_valid),
        two_or_less_crossing_sentences=two_or_less,
        two_or_less_crossing=_percent(two_or_less, n_valid),
        words=words,
        correct_tags=tags,
        tagging_accuracy=_percent(tags, words),
    )


def make_result(
    sentences: list[EvalbSentence],
    cutoff_len: int,
    messages: list[str] | None = None,
    *,
    aborted: bool = False,
    evalb_stdout: str | None = None,
) -> EvalbResult:
    """An EvalbResult with both summaries computed from the per-sentence records (evalb's
    totals are sums of the per-sentence integers, so nothing is lost)."""
    return EvalbResult(
        sentences=sentences,
        all=summarize(sentences),
        cutoff=summarize(sentences, cutoff_len),
        cutoff_len=cutoff_len,
        messages=list(messages or []),
        aborted=aborted,
        evalb_stdout=evalb_stdout,
    )


# --------------------------------------------------------------------------- the report
def format_sentence(s: EvalbSentence) -> str:
    """The sentence's line of evalb's table (individual_result), newline included."""
    return (
        f"{s.id:4d}  {s.length:3d}    {s.status:d}  "
        f"{s.recall:6.2f} {s.precision:6.2f}   {s.matched_brackets:3d}    "
        f"{s.gold_brackets:3d}  {s.test_brackets:3d}    {s.crossing:3d}"
        f"   {s.words:4d}  {s.correct_tags:4d}   {s.tag_accuracy:6.2f}\n"
    )


def _f(value: float, is_nan: bool = False) -> str:
    # glibc prints the NaN of 0.0/0.0 on x86-64 (sign bit set) as "-nan"
    return "  -nan" if is_nan else f"{value:6.2f}"


def _format_block(title: str, s: EvalbSummary) -> str:
    return (
        f"\n-- {title} --\n"
        f"Number of sentence        = {s.sentences:6d}\n"
        f"Number of Error sentence  = {s.error_sentences:6d}\n"
        f"Number of Skip  sentence  = {s.skipped_sentences:6d}\n"
        f"Number of Valid sentence  = {s.valid_sentences:6d}\n"
        f"Bracketing Recall         = {_f(s.recall)}\n"
        f"Bracketing Precision      = {_f(s.precision)}\n"
        f"Bracketing FMeasure       = {_f(s.f1, s.f1_is_nan)}\n"
        f"Complete match            = {_f(s.complete_match)}\n"
        f"Average crossing          = {_f(s.average_crossing)}\n"
        f"No crossing               = {_f(s.no_crossing)}\n"
        f"2 or less crossing        = {_f(s.two_or_less_crossing)}\n"
        f"Tagging accuracy          = {_f(s.tagging_accuracy)}\n"
    )


def format_report(result: EvalbResult) -> str:
    """evalb's stdout (with DEBUG 0) for this result, byte for byte: the table, the totals
    line, and the two summaries; without them if evalb stopped early (`aborted`)."""
    out = [HEADER, *(format_sentence(s) for s in result.sentences)]
    if result.aborted:
        return "".join(out)
    a = result.all
    out.append(_RULE)
    if a.gold_brackets > 0 and a.test_brackets > 0:
        out.append(
            f"                {a.recall:6.2f} {a.precision:6.2f} {a.matched_brackets:6d} "
            f"{a.gold_brackets:5d} {a.test_brackets:5d}  {a.crossing:5d}"
        )
    out.append(f"  {a.words:5d} {a.correct_tags:5d}   {a.tagging_accuracy:6.2f}")
    out.append("\n=== Summary ===\n")
    out.append(_format_block("All", a))
    out.append(_format_block(f"len<={result.cutoff_len}", result.cutoff))
    return "".join(out)


def format_summary(result: EvalbResult) -> str:
    """A few lines for a terminal or a log: P, R, F1, complete match and tagging accuracy
    over all sentences and over short ones, and how many sentences were left out (evalb
    scores only valid sentences, so a parser that fails on hard sentences looks better)."""

    def line(name: str, s: EvalbSummary) -> str:
        f1 = "nan" if s.f1_is_nan else f"{s.f1:.2f}"
        return (
            f"{name:<9} F1 {f1}  P {s.precision:.2f}  R {s.recall:.2f}  "
            f"complete match {s.complete_match:.2f}  tagging {s.tagging_accuracy:.2f}  "
            f"({s.sentences} sentences: {s.valid_sentences} valid, "
            f"{s.error_sentences} errors, {s.skipped_sentences} skipped)"
        )

    lines = [line("all", result.all), line(f"len<={result.cutoff_len}", result.cutoff)]
    left_out = result.all.error_sentences + result.all.skipped_sentences
    if left_out:
        lines.append(
            f"note: {left_out} of {result.all.sentences} sentences are left out of these "
            "scores (evalb's error and skipped sentences)"
        )
    if result.aborted:
        lines.append(
            f"note: evalb would have stopped after {len(result.sentences)} sentences "
            "(too many errors); these scores cover only those"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the scorer
@dataclass
class _Bracket:
    start: int = -1
    end: int = -1
    label: bytes = b""
    result: int = 9  # 0 unmatched, 1 matched, 5 deleted, 9 not yet looked at


@dataclass
class _Quote:
    """A leaf that the 2006 fix may put back (evalb's s_term_ind)."""

    word: bytes
    label: bytes
    index: int  # the word index it has, or would have had if kept
    bracket: int  # the number of brackets opened before it
    ends: list[int]  # the brackets open around it


@dataclass
class _Tree:
    terminals: list[tuple[bytes, bytes]]  # (word, tag) of the words not deleted
    brackets: list[_Bracket]
    quotes: list[_Quote]
    length: int  # evalb's r_wn1: leaves not in DELETE_LABEL_FOR_LENGTH


class _StopError(Exception):
    pass


class _Evalb:
    """evalb.c's globals and functions; one instance scores one pair of files."""

    def __init__(self, params: EvalbParams) -> None:
        enc = str.encode
        self.p = params
        self.delete = [enc(x) for x in params.delete_labels]
        self.delete_for_length = {enc(x) for x in params.delete_labels_for_length}
        self.quote_labels = {enc(x) for x in params.quote_labels}
        self.eq_labels = [(enc(a), enc(b)) for a, b in params.eq_labels]
        self.eq_words = [(enc(a), enc(b)) for a, b in params.eq_words]
        self.error_count = 0
        self.line = 0
        self.status = 0
        self.messages: list[str] = []
        self.sentence_errors: list[str] = []
        self.sentences: list[EvalbSentence] = []
        # evalb's bracket stack; a ")" with nothing open reads stack[-1], stack[-2], ...:
        # in the gcc x86-64 build these are zero padding before the array, kept between
        # sentences, so they are kept here too.
        self.stack: dict[int, int] = {}
        self.stack_top = 0

    # ----------------------------------------------------------- errors
    def error(self, message: str, repeat: int = 1) -> None:
        """evalb's Error(): the sentence becomes an error; stop at too many errors."""
        self.status = 1
        for _ in range(repeat):
            text = f"{self.line} : {message}"
            self.messages.append(text)
            self.sentence_errors.append(text)
            count = self.error_count
            self.error_count += 1
            if count > self.p.max_error:
                raise _StopError(text)

    def error_forever(self, message: str) -> None:
        """evalb's read_line() repeats Error("Reading sentence") without moving on, until
        the error count makes it exit."""
        left = max(self.p.max_error + 2 - self.error_count, 1)
        if left > _MAX_REPEATED_MESSAGES:
            self.error(f"{message} (evalb repeats this {left} times)")
            raise _StopError(message)
        self.error(message, repeat=left)
        raise AssertionError("unreachable: the repeated error stops evalb")

    # ----------------------------------------------------------- predicates
    def is_delete(self, label: bytes) -> bool:
        return label in self.delete

    def label_eq(self, a: bytes, b: bytes) -> bool:
        if a == b:
            return True
        return any((a == x and b == y) or (a == y and b == x) for x, y in self.eq_labels)

    def word_eq(self, a: bytes, b: bytes) -> bool:
        if a == b:
            return True
        return any((a == x and b == y) or (a == y and b == x) for x, y in self.eq_words)

    # ----------------------------------------------------------- read_line
    def push(self, item: int) -> None:
        self.stack[self.stack_top] = item
        self.stack_top += 1

    def pop(self) -> int:
        item = self.stack.get(self.stack_top - 1, 0)
        top = self.stack_top
        self.stack_top -= 1
        if top < 0:
            self.error("Bracketing unbalance (too many close bracket)")
        return item

    def read_line(self, buf: bytes) -> _Tree:
        """evalb's read_line(): the words, brackets and quote leaves of one line."""
        terminals: list[tuple[bytes, bytes]] = []
        brackets: list[_Bracket] = []
        quotes: list[_Quote] = []
        length = 0
        self.stack_top = 0
        n = len(buf)
        p = 0
        bid = 0

        def bracket(b: int) -> _Bracket:
            while len(brackets) <= b:
                brackets.append(_Bracket())
            return brackets[b]

        while p < n:
            c = buf[p]
            if c in _SPACE:
                p += 1
            elif c == 0x28:  # "("
                p += 1
                s = p
                while p < n and buf[p] not in _TERMINATOR:
                    p += 1
                label = buf[s:p]
                q = p
                if q < n and buf[q] in _SPACE:
                    q += 1
                    while q < n and buf[q] in _SPACE:
                        q += 1
                    s = q
                    while q < n and buf[q] not in _TERMINATOR:
                        q += 1
                    word = buf[s:q]
                    closes = q < n and buf[q] == 0x29  # ")"
                    if closes and label not in self.delete_for_length:
                        length += 1
                    if closes and label in self.quote_labels and word in (b"'", b'"', b"/"):
                        ends = [self.stack.get(k, 0) for k in range(self.stack_top)]
                        quotes.append(_Quote(word, label, len(terminals), bid, ends))
                    if closes and self.is_delete(label):
                        p = q + 1
                        continue
                    if closes:
                        terminals.append((word, label))
                        p = q + 1
                        continue
                    if not (q < n and buf[q] == 0x28):
                        self.error("More than two elements in a bracket")
                # a non-terminal: a bracket opens here
                b = bracket(bid)
                b.start = len(terminals)
                b.label = label
                self.push(bid)
                bid += 1
            elif c == 0x29:  # ")"
                bracket(self.pop()).end = len(terminals)
                p += 1
            else:
                self.error_forever("Reading sentence")
        if self.stack_top != 0:
            self.error("Bracketing is unbalanced (too many open bracket)")
        return _Tree(terminals, brackets[:bid], quotes, length)

    # ----------------------------------------------------------- calc_result
    def fix_quote(self, gold: _Tree, test: _Tree) -> None:
        """Ellis's fix: put back the quote leaves one side deleted and the other kept."""
        q1, q2 = gold.quotes, test.quotes
        for i in range(len(q2)):
            ind = q2[i].index
            for j in range(len(q1)):
                if q1[j].index != ind or q1[j].label == q2[i].label:
                    continue
                if self.is_delete(q1[j].label) and not self.is_delete(q2[i].label):
                    self.reinsert(q1[j], gold)
                    for k in range(j, len(q1)):
                        q1[k].index += 1
                elif self.is_delete(q2[i].label) and not self.is_delete(q1[j].label):
                    self.reinsert(q2[i], test)
                    for k in range(i, len(q2)):
                        q2[k].index += 1

    @staticmethod
    def reinsert(quote: _Quote, tree: _Tree) -> None:
        """evalb's reinsert_term(): the leaf back in its place, the brackets moved on."""
        tree.terminals.insert(quote.index, (quote.word, quote.label))
        for k, b in enumerate(tree.brackets):
            if k >= quote.bracket:
                b.start += 1
                b.end += 1
        for k in quote.ends:
            tree.brackets[k].end += 1

    def massage(self, tree: _Tree) -> int:
        """evalb's massage_data(): mark empty and deleted brackets (5), cut labels; the
        number of brackets left."""
        for b in tree.brackets:
            b.result = 0
            if b.start == b.end:
                b.result = 5
                continue
            for cut, ch in enumerate(b.label):
                if ch in (0x2D, 0x3D):  # "-", "="
                    b.label = b.label[:cut]
                    break
            if any(self.label_eq(b.label, d) for d in self.delete):
                b.result = 5
        return sum(1 for b in tree.brackets if b.result != 5)

    def record(
        self,
        length: int,
        words: int = 0,
        gold_brackets: int = 0,
        test_brackets: int = 0,
        match: int = 0,
        crossing: int = 0,
        correct_tag: int = 0,
    ) -> None:
        """evalb's individual_result(): one line of the table."""
        self.sentences.append(
            EvalbSentence(
                id=self.line,
                length=length,
                status=self.status,
                recall=_percent(match, gold_brackets),
                precision=_percent(match, test_brackets),
                matched_brackets=match,
                gold_brackets=gold_brackets,
                test_brackets=test_brackets,
                crossing=crossing,
                words=words,
                correct_tags=correct_tag,
                tag_accuracy=_percent(correct_tag, words),
                errors=tuple(self.sentence_errors),
            )
        )

    def calc_result(self, gold: _Tree, test: _Tree) -> None:
        length = gold.length
        if not test.terminals:
            self.status = 2
            self.record(length)
            return
        if len(gold.terminals) != len(test.terminals):
            self.fix_quote(gold, test)
            if len(gold.terminals) != len(test.terminals):
                self.error(f"Length unmatch ({len(gold.terminals)}|{len(test.terminals)})")
                self.record(length)
                return
        for (w1, _), (w2, _) in zip(gold.terminals, test.terminals, strict=True):
            if not self.word_eq(w1, w2):
                self.error(f"Words unmatch ({_show(w1)}|{_show(w2)})")
                self.record(length)
                return

        r_bn1 = self.massage(gold)
        r_bn2 = self.massage(test)

        match = 0
        for b1 in gold.brackets:
            if b1.result == 5:
                continue
            for b2 in test.brackets:
                if (
                    b2.result == 0
                    and b1.start == b2.start
                    and b1.end == b2.end
                    and (not self.p.labeled or self.label_eq(b1.label, b2.label))
                ):
                    b1.result = b2.result = 1
                    match += 1
                    break

        crossing = 0
        for b2 in test.brackets:
            if b2.result == 5:
                continue
            for b1 in gold.brackets:
                if b1.result != 5 and (
                    (b1.start < b2.start and b1.end > b2.start and b1.end < b2.end)
                    or (b1.start > b2.start and b1.start < b2.end and b1.end > b2.end)
                ):
                    crossing += 1
                    break

        correct_tag = sum(
            1
            for (_, t1), (_, t2) in zip(gold.terminals, test.terminals, strict=True)
            if self.label_eq(t1, t2)
        )
        self.record(length, len(gold.terminals), r_bn1, r_bn2, match, crossing, correct_tag)

    # ----------------------------------------------------------- main
    def run(self, gold_lines: Sequence[str], test_lines: Sequence[str]) -> EvalbResult:
        gold_chunks = _fgets_chunks(gold_lines)
        test_chunks = _fgets_chunks(test_lines)
        try:
            self.line = 1
            for k, gold_buf in enumerate(gold_chunks):
                self.status = 0
                self.sentence_errors = []
                gold = self.read_line(gold_buf)
                if k >= len(test_chunks):
                    self.error("Number of lines unmatch (too many lines in gold file)")
                    break
                test = self.read_line(test_chunks[k])
                self.calc_result(gold, test)
                self.line += 1
            if len(test_chunks) > len(gold_chunks):
                self.error("Number of lines unmatch (too many lines in test file)")
        except _StopError as stop:
            result = make_result(self.sentences, self.p.cutoff_len, self.messages, aborted=True)
            raise EvalbAbortError(
                f"evalb stops at line {self.line} after {self.error_count} errors "
                f"(MAX_ERROR {self.p.max_error}): {stop}",
                result,
            ) from None
        return make_result(self.sentences, self.p.cutoff_len, self.messages)


def _show(word: bytes) -> str:
    return word.decode("utf-8", errors="replace")


def _fgets_chunks(lines: Sequence[str]) -> list[bytes]:
    """The buffers evalb's fgets(buff, 5000, fd) reads from these lines: one per line,
    unless a line (with its newline) is over 4999 bytes; each cut at a NUL byte."""
    chunks = []
    for i, line in enumerate(lines, start=1):
        if line.endswith("\n"):
            line = line[:-1]
        if "\n" in line:
            raise InputError(f"tree {i} holds a newline: give one tree per list item")
        data = line.encode("utf-8") + b"\n"
        for k in range(0, len(data), _FGETS_BYTES):
            chunk = data[k : k + _FGETS_BYTES]
            chunks.append(chunk.split(b"\0", 1)[0])
    return chunks


def score_trees(
    gold_lines: Sequence[str], test_lines: Sequence[str], params: EvalbParams = COLLINS
) -> EvalbResult:
    """Score test trees against gold trees, one bracketed tree per line, as evalb does.

    Args:
        gold_lines, test_lines: one tree per item (a trailing newline is allowed),
            aligned line by line; an empty line or a failed parse in the test is a
            skipped sentence (status 2), not an error.
        params: COLLINS (the default), or load_params("some.prm").

    Raises:
        InputError: the two lists have different lengths (evalb would go on, scoring
            only the common prefix).
        EvalbAbortError: evalb would stop before its summary (more than MAX_ERROR + 1
            errors, or a line it cannot read); `.result` has the sentences before.
    """
    if len(gold_lines) != len(test_lines):
        raise InputError(
            f"gold has {len(gold_lines)} trees but test has {len(test_lines)}: they must "
            "align line by line"
        )
    return _Evalb(params).run(gold_lines, test_lines)


def score_files(gold: str | Path, test: str | Path, params: EvalbParams = COLLINS) -> EvalbResult:
    """score_trees on two files (plain or .gz, UTF-8, one tree per line).

    Raises:
        InputError: invalid UTF-8 (naming FILE:LINE), a missing file, or different line
            counts (naming both files and both counts).
        EvalbAbortError: as score_trees.
    """
    gold_lines = list(read_lines(gold))
    test_lines = list(read_lines(test))
    if len(gold_lines) != len(test_lines):
        raise InputError(
            f"{gold} has {len(gold_lines)} lines but {test} has {len(test_lines)}: "
            "gold and test trees must align line by line"
        )
    return score_trees(gold_lines, test_lines, params)


__all__ = [
    "COLLINS",
    "EvalbAbortError",
    "EvalbParams",
    "EvalbResult",
    "EvalbSentence",
    "EvalbSummary",
    "format_params",
    "format_report",
    "format_sentence",
    "format_summary",
    "load_params",
    "make_result",
    "parse_params",
    "score_files",
    "score_trees",
    "summarize",
]
