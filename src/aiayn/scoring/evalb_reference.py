"""The real EVALB, built from its C sources and run, its output read back into an
EvalbResult: the reference that aiayn.scoring.evalb is tested against, and a second
opinion a training recipe can ask for when the C sources are at hand.

Reading evalb's stdout is checked, not trusted: every per-sentence percentage and every
summary figure evalb prints must agree (to its two printed decimals) with the one
recomputed from the integers it prints, or run_evalb raises. The result's percentages
are those recomputed values, unrounded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

from aiayn.files import InputError
from aiayn.scoring.evalb import (
    COLLINS,
    EvalbAbortError,
    EvalbResult,
    EvalbSentence,
    EvalbSummary,
    load_params,
    make_result,
)

#: The compiler flags of EVALB's own Makefile (`gcc -Wall -g`: no optimisation, so the
#: binary behaves as everyone's), then fallbacks for compilers whose default C standard
#: (C23 in GCC 15) refuses the 1997 K&R declarations.
_FLAG_SETS = (["-g"], ["-g", "-std=gnu89"], ["-g", "-std=gnu89", "-fpermissive"])


class EvalbBuildError(RuntimeError):
    """EVALB could not be built: no evalb.c, no C compiler, or the compiler failed."""


def find_c_compiler() -> str | None:
    """$CC, else gcc, else cc on PATH; None if there is none."""
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return cc
    return shutil.which("gcc") or shutil.which("cc")


def build_evalb(source_dir: str | Path, work_dir: str | Path) -> Path:
    """Copy the EVALB sources (the directory holding evalb.c) into `work_dir` and compile
    them there, as its Makefile does; returns the path of the `evalb` binary.

    The source directory is never written to (it may be read-only, shared).

    Raises:
        EvalbBuildError: `source_dir` has no evalb.c, there is no C compiler, or it
            fails (its messages are included).
    """
    source_dir, work_dir = Path(source_dir), Path(work_dir)
    if not (source_dir / "evalb.c").is_file():
        raise EvalbBuildError(
            f"{source_dir}: no evalb.c here; give the EVALB directory "
            "(https://nlp.cs.nyu.edu/evalb/), which holds evalb.c and COLLINS.prm"
        )
    cc = find_c_compiler()
    if cc is None:
        raise EvalbBuildError(
            "no C compiler found (looked for $CC, gcc and cc on PATH): install gcc to "
            "build the reference EVALB"
        )
    work_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source_dir, work_dir, dirs_exist_ok=True)
    binary = work_dir / "evalb"
    binary.unlink(missing_ok=True)  # a binary copied along may be for another machine
    failures = []
    for flags in _FLAG_SETS:
        cmd = [cc, *flags, "-o", str(binary), str(work_dir / "evalb.c")]
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        if done.returncode == 0 and binary.is_file():
            return binary
        failures.append(f"$ {' '.join(cmd)}\n{done.stderr.strip()}")
    raise EvalbBuildError(f"{cc} could not compile evalb.c:\n" + "\n".join(failures))


_SENTENCE = re.compile(
    r"\s*(\d+)\s+(\d+)\s+([012])\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+)\s+(\d+)\s+(\d+)"
    r"\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+\.\d\d)"
)
_SUMMARY_LINE = re.compile(r"(.+?)\s+=\s+(\S+)")
_KEYS = {
    "Number of sentence": "sentences",
    "Number of Error sentence": "error_sentences",
    "Number of Skip  sentence": "skipped_sentences",
    "Number of Valid sentence": "valid_sentences",
    "Bracketing Recall": "recall",
    "Bracketing Precision": "precision",
    "Bracketing FMeasure": "f1",
    "Complete match": "complete_match",
    "Average crossing": "average_crossing",
    "No crossing": "no_crossing",
    "2 or less crossing": "two_or_less_crossing",
    "Tagging accuracy": "tagging_accuracy",
}


def _close(printed: float, value: float) -> bool:
    return abs(printed - value) <= 0.005 + 1e-9


def _parse_sentences(stdout: str) -> list[EvalbSentence]:
    sentences = []
    for line in stdout.splitlines():
        m = _SENTENCE.fullmatch(line)
        if not m:
            continue
        ints = [int(m.group(k)) for k in (1, 2, 3, 6, 7, 8, 9, 10, 11)]
        sid, length, status, match, gold, test, crossing, words, tags = ints
        s = EvalbSentence(
            id=sid,
            length=length,
            status=status,
            recall=100.0 * match / gold if gold else 0.0,
            precision=100.0 * match / test if test else 0.0,
            matched_brackets=match,
            gold_brackets=gold,
            test_brackets=test,
            crossing=crossing,
            words=words,
            correct_tags=tags,
            tag_accuracy=100.0 * tags / words if words else 0.0,
        )
        printed = (float(m.group(4)), float(m.group(5)), float(m.group(12)))
        if not all(map(_close, printed, (s.recall, s.precision, s.tag_accuracy))):
            raise RuntimeError(f"evalb printed percentages that its counts do not give: {line!r}")
        sentences.append(s)
    return sentences


def _parse_summaries(stdout: str) -> tuple[int, dict[str, dict[str, float]]]:
    """(cutoff length, {"All" or "len<=N": {field: printed value}})."""
    blocks: dict[str, dict[str, float]] = {}
    cutoff = -1
    current: dict[str, float] | None = None
    for line in stdout.split("=== Summary ===", 1)[1].splitlines():
        if m := re.fullmatch(r"-- (All|len<=(-?\d+)) --", line.strip()):
            current = blocks.setdefault(m.group(1), {})
            if m.group(2) is not None:
                cutoff = int(m.group(2))
        elif (
            current is not None
            and (m := _SUMMARY_LINE.fullmatch(line.strip()))
            and m.group(1) in _KEYS
        ):
            current[_KEYS[m.group(1)]] = float(m.group(2))  # "-nan" reads as nan
    if set(blocks) != {"All", f"len<={cutoff}"}:
        raise RuntimeError("evalb's summary is not in the expected form (-- All --, -- len<=N --)")
    return cutoff, blocks


def _check_summary(printed: dict[str, float], s: EvalbSummary, where: str) -> None:
    for name, value in printed.items():
        ours = getattr(s, name)
        if name == "f1" and math.isnan(value):
            ok = s.f1_is_nan
        elif name.endswith("sentences"):
            ok = value == ours
        else:
            ok = not (name == "f1" and s.f1_is_nan) and _close(value, ours)
        if not ok:
            raise RuntimeError(
                f"evalb's summary ({where}) prints {name} = {value}, but its per-sentence "
                f"lines give {ours}"
            )


def run_evalb(
    binary: str | Path,
    gold: str | Path,
    test: str | Path,
    params_file: str | Path,
    *,
    timeout: float = 600.0,
) -> EvalbResult:
    """Run `evalb -p PARAMS_FILE GOLD TEST` and read its output into an EvalbResult
    (`evalb_stdout` holds the text, `messages` its stderr lines).

    Raises:
        EvalbAbortError: evalb stopped before its summary (too many errors); `.result`
            holds the sentences it printed.
        RuntimeError: evalb failed otherwise (a file it cannot open, a crash), or its
            output is not what this module reads (another evalb version?).
    """
    cmd = [str(binary), "-p", str(params_file), str(gold), str(test)]
    done = subprocess.run(cmd, capture_output=True, timeout=timeout)
    stdout = done.stdout.decode("utf-8", errors="replace")
    stderr = done.stderr.decode("utf-8", errors="replace")
    messages = stderr.splitlines()
    sentences = _parse_sentences(stdout)
    by_line: dict[int, list[str]] = {}
    for message in messages:
        if m := re.match(r"(\d+) : ", message):
            by_line.setdefault(int(m.group(1)), []).append(message)
    sentences = [dataclasses.replace(s, errors=tuple(by_line.get(s.id, ()))) for s in sentences]
    if "=== Summary ===" not in stdout:
        if done.returncode != 0 and stdout.startswith("  Sent."):
            try:
                cutoff_len = load_params(params_file).cutoff_len
            except InputError:
                cutoff_len = COLLINS.cutoff_len
            result = make_result(sentences, cutoff_len, messages, aborted=True, evalb_stdout=stdout)
            last = messages[-1] if messages else "no message"
            raise EvalbAbortError(f"evalb stopped before its summary: {last}", result)
        raise RuntimeError(
            f"{' '.join(cmd)} failed (exit status {done.returncode}): {stderr.strip()}"
        )
    cutoff_len, printed = _parse_summaries(stdout)
    result = make_result(sentences, cutoff_len, messages, evalb_stdout=stdout)
    _check_summary(printed["All"], result.all, "All")
    _check_summary(printed[f"len<={cutoff_len}"], result.cutoff, f"len<={cutoff_len}")
    return result


__all__ = ["EvalbBuildError", "build_evalb", "find_c_compiler", "run_evalb"]
