"""Parsing's test scores: each system's trees (constrained, free, unrepaired, the
baselines) scored by aiayn's EVALB and the real one, and the terminal's table."""

from __future__ import annotations

import logging
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.experiments.tasks.base import TaskData
from aiayn.files import write_text_atomic

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def _pcfg_baseline(data: TaskData, words: list[list[str]], out: Path) -> dict[str, Path]:
    """The PCFG baseline (`aiayn.parsing.pcfg`: parent-annotated, Markovized, counted from
    the gold training trees, CKY) over the test sentences, in RUN/test.pcfg.trees."""
    import time

    from aiayn.parsing.pcfg import Pcfg
    from aiayn.parsing.trees import read_tree_lines

    train = data.files.get("train_trees")
    if train is None or not Path(train).is_file():
        return {}
    t0 = time.perf_counter()
    grammar = Pcfg().train(tree for _, tree in read_tree_lines(train))
    trees = [grammar.parse(w).to_string() for w in words]
    path = out / "test.pcfg.trees"
    write_text_atomic(path, "".join(f"{t}\n" for t in trees))
    log.info(
        "PCFG baseline: %d symbols, %d sentences parsed in %.1f s (%d without a parse)",
        len(grammar.symbols),
        len(trees),
        time.perf_counter() - t0,
        grammar.failures,
    )
    return {"pcfg": path}


def _scores(summary: Any) -> dict[str, Any]:
    """The numbers results.json keeps of an EVALB summary."""
    return {
        k: getattr(summary, k)
        for k in (
            "f1",
            "precision",
            "recall",
            "complete_match",
            "tagging_accuracy",
            "sentences",
            "error_sentences",
            "skipped_sentences",
            "matched_brackets",
            "gold_brackets",
            "test_brackets",
        )
    }


def _score_all(
    gold: Path, systems: dict[str, Path], evalb_source: str, work: Path
) -> dict[str, Any]:
    """Each system's scores by aiayn's EVALB and, when given EVALB's source, by EVALB itself
    (COLLINS.prm), with whether the two printed reports agree.

    COLLINS.prm stops after 10 sentences of unequal length, printing no summary; the
    recipe's trees have the input's words, but a punctuation tag unlike the gold one makes
    such a sentence. Where EVALB would stop, the scores are those of COLLINS.prm with no
    limit, marked `evalb_stops`, and EVALB itself is not asked. A machine with no C
    compiler scores with aiayn's EVALB alone, with a warning.
    """
    from aiayn.scoring.evalb import COLLINS, EvalbAbortError, format_report
    from aiayn.scoring.evalb import score_files as score_trees_files

    ours, scores = {}, {}
    for name, path in systems.items():
        try:
            ours[name], stops = score_trees_files(gold, path, COLLINS), False
        except EvalbAbortError:
            ours[name] = score_trees_files(gold, path, replace(COLLINS, max_error=10**9))
            stops = True
        r = ours[name]
        scores[name] = {
            "aiayn": _scores(r.all),
            "aiayn_40": _scores(r.cutoff),
            "evalb_stops": stops,
        }
    if evalb_source:
        from aiayn.scoring.evalb_reference import EvalbBuildError, build_evalb, run_evalb

        try:
            binary = build_evalb(Path(evalb_source), work)
        except EvalbBuildError as e:
            log.warning("EVALB not built (%s): aiayn's scorer alone", e)
            for name in systems:
                scores[name]["evalb_error"] = f"not built: {e}"
            return scores
        params = Path(evalb_source) / "COLLINS.prm"
        for name, path in systems.items():
            if scores[name]["evalb_stops"]:
                continue
            try:
                ref = run_evalb(binary, gold, path, params)
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                # an external scorer's failure (EVALB segfaults on some very long trees) is
                # a result beside aiayn's own scores, never the end of an hour's run
                log.warning("EVALB failed on %s (%s): aiayn's scores stand alone", name, e)
                scores[name]["evalb_error"] = str(e)
                continue
            scores[name]["evalb"] = _scores(ref.all)
            report = format_report(ours[name])
            write_text_atomic(work / f"{name}.aiayn.txt", report)
            write_text_atomic(work / f"{name}.evalb.txt", ref.report)
            scores[name]["reports_equal"] = report.strip() == ref.report.strip()
    return scores


def format_parse_results(results: dict[str, Any]) -> str:
    """F1 by both scorers, the ablations and the speed, for the terminal."""
    s = results["scores"]
    p = results["parse"]
    t = results["train"]
    d = results["config"]["decode"]
    lines = [
        f"parse test ({p['sentences']} sentences), average of {len(results['averaged'])} "
        f"checkpoints, {results['parameters']:,} params; beam {d['beam']}, alpha {d['alpha']:g}",
    ]
    for name, label in (
        ("model", "model, constrained"),
        ("model_unconstrained", "model, free+repairs"),
        ("model_without_repairs", "model, no repairs"),
        ("pcfg", "PCFG baseline"),
        ("right_branching", "right-branching"),
    ):
        if name not in s:
            continue
        ours = s[name]["aiayn"]
        row = (
            f"  {label:18s} F1 {ours['f1']:6.2f}  P {ours['precision']:6.2f}  "
            f"R {ours['recall']:6.2f}  complete {ours['complete_match']:6.2f}  (aiayn's EVALB)"
        )
        if "evalb" in s[name]:
            ev = s[name]["evalb"]
            same = "reports equal" if s[name]["reports_equal"] else "REPORTS DIFFER"
            row += f"; EVALB F1 {ev['f1']:6.2f} ({same})"
        elif "evalb_error" in s[name]:
            row += f"; EVALB failed: {s[name]['evalb_error'][:120]}"
        lines.append(row)
    free = p.get("unconstrained", {})
    lines.append(
        f"  constrained: {p['ill_formed']} of {p['sentences']} outputs ill-formed, "
        f"{p['sentences_per_s']:.2f} sentences/s; unconstrained: "
        f"{free.get('ill_formed', '-')} ill-formed (repaired), "
        f"{free.get('sentences_per_s', 0.0):.2f} sentences/s"
    )
    lines.append(
        f"  training: {t['steps']} steps, {t['epochs']} epochs, "
        f"{t['train_seconds'] / 60:.1f} min ({t['stopped_by']})"
    )
    tuning = results.get("tuning")
    if tuning:
        tried = ", ".join(f"{r['beam']}/{r['alpha']:g}: {r['f1']:.2f}" for r in tuning["tried"])
        lines.insert(
            1, f"  chosen on dev ({tuning['sentences']} sentences; F1 by beam/alpha {tried})"
        )
    return "\n".join(lines)
