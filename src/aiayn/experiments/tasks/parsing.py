"""Parsing (section 6.3): a treebank in, EVALB F1 out.

The task's stages of `aiayn recipe` (`aiayn.experiments.tasks.base`):

    prepare   treebank -> trees, words and linearized trees per split (`aiayn data ptb`),
              silver trees mixed in, prepared with the linearized trees as the target
    tune      beam and alpha chosen on the development set by bracketing F1
    test      the test set parsed and scored with aiayn's EVALB and, when the recipe names
              its source, the real EVALB, each on

    the model's trees decoded under the tree constraint (`decoding.tree_constraint`),
    the model's trees decoded freely, the raw outputs repaired into trees (`decoding.parse`),
    the free outputs without repairs (an ill-formed output scores as no constituent),
    a right-branching baseline over the same words,
    a PCFG counted from the training trees (`aiayn.parsing.pcfg`), CKY over the same words,

so the reader sees what the model adds, what the constraint adds and what the repairs add.
A failing EVALB (no compiler, a crash) is recorded beside aiayn's scores, never raised.
Files in RUN:

    RUN/data/raw/treebank.zip  the NLTK sample, when no treebank was given (downloaded, verified)
    RUN/data/ptb/       train/dev/test .trees, .words, .lin (`aiayn data ptb`), manifest
    RUN/data/train.mixed.{words,lin}  gold and silver trees mixed ([recipe] silver)
    RUN/data/prepared/  subword model and id tensors (the linearized trees as the target)
    RUN/tune/           the development set parsed at each beam and alpha tried
    RUN/test.{lin,trees}         the constrained search's outputs and trees
    RUN/test.unconstrained.{lin,trees}  the free search's outputs and their repaired trees
    RUN/test.{norepair,rightbranch,pcfg}.trees  the ablation and the baselines
    RUN/evalb/          EVALB built from its source, and its reports
"""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import Config, ConfigError, DecodeConfig
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks.base import Outcome, RunContext, Scored, TaskData, refuse_options
from aiayn.files import UsageError, read_lines, sha256_file, write_text_atomic

if TYPE_CHECKING:
    from aiayn.decoding.translate import Decoder, SubwordTokenizer
    from aiayn.decoding.tree_constraint import TreeLimits
    from aiayn.experiments.stages import Trained

log = logging.getLogger(__name__)

#: The file suffix of the source side: the words (the target's: `ptb.TARGETS`).
SOURCE = "words"


def mix_silver(
    gold: Path, silver: Path, ratio: float, out: Path, target: str = "lin"
) -> dict[str, int | float]:
    """Write OUT.words/.lin: the gold pairs repeated to reach `ratio` silver per gold, then
    every silver pair (the paper's semi-supervised setting mixes both). `gold` and `silver`
    are prefixes of .words files and of target files (suffix `target`).

    Returns:
        Counts: gold, silver, gold_copies, and the ratio reached.
    """
    g = {s: list(read_lines(Path(f"{gold}.{s}"))) for s in (SOURCE, target)}
    v = {s: list(read_lines(Path(f"{silver}.{s}"))) for s in (SOURCE, target)}
    n_gold, n_silver = len(g[SOURCE]), len(v[SOURCE])
    copies = max(1, round(n_silver / (ratio * n_gold))) if n_gold else 1
    for side in (SOURCE, target):
        lines = g[side] * copies + v[side]
        write_text_atomic(Path(f"{out}.{side}"), "".join(f"{x}\n" for x in lines))
    return {
        "gold": n_gold,
        "silver": n_silver,
        "gold_copies": copies,
        "silver_per_gold": n_silver / max(1, n_gold * copies),
    }


def _first_lines(prefix: Path, suffixes: tuple[str, ...], out: Path, n: int) -> None:
    for suffix in suffixes:
        lines = list(read_lines(Path(f"{prefix}.{suffix}")))[:n]
        write_text_atomic(Path(f"{out}.{suffix}"), "".join(f"{x}\n" for x in lines))


def prepare_data(recipe: RecipeConfig, cfg: Config, out: Path, data: str | Path | None) -> TaskData:
    """The treebank's splits as files, silver mixed in, a smoke run's truncation, prepared.
    TaskData.files: "dev" and "test", the prefixes of their .words, .trees (and target)
    files."""
    from aiayn.data.download import download_ptb_sample
    from aiayn.data.prepare import prepare
    from aiayn.parsing.ptb import TARGETS, prepare_treebank, tree_file_to_pairs

    source = Path(data) if data is not None else download_ptb_sample(out / "data" / "raw")
    ptb = out / "data" / "ptb"
    treebank = prepare_treebank(source, ptb, split=recipe.treebank_split)
    train, dev, test = ptb / "train", ptb / "dev", ptb / "test"
    target = TARGETS[recipe.linearization]
    if recipe.max_train_pairs:  # a smoke run: the first gold trees (silver comes after)
        n = recipe.max_train_pairs
        _first_lines(train, (SOURCE, target), out / "data" / f"train.first{n}", n)
        train = out / "data" / f"train.first{n}"
    silver_counts = None
    if recipe.silver:
        silver = out / "data" / "silver"
        tree_file_to_pairs(
            Path(recipe.silver),
            Path(f"{silver}.{SOURCE}"),
            Path(f"{silver}.{target}"),
            with_words=recipe.linearization == "words",
        )
        mixed = out / "data" / "train.mixed"
        silver_counts = mix_silver(train, silver, recipe.silver_ratio, mixed, target)
        train = mixed
        log.info("training on gold and silver trees: %s", silver_counts)
    if recipe.max_test_pairs:
        n = recipe.max_test_pairs
        for name in ("dev", "test"):
            _first_lines(
                ptb / name, (SOURCE, target, "trees"), out / "data" / f"{name}.first{n}", n
            )
        dev, test = out / "data" / f"dev.first{n}", out / "data" / f"test.first{n}"
    prepared = out / "data" / "prepared"
    manifest = prepare(
        SOURCE,
        target,
        train,
        ptb / "dev",  # validation perplexity on the whole development set
        None,
        prepared,
        vocab_size=recipe.vocab_size,
        max_len=cfg.train.max_len,
        max_len_ratio=cfg.train.max_len_ratio,
        split_by_script=False,  # "(NP" and ")VP" one piece each
    )
    return TaskData(
        prepared,
        manifest,
        files={
            "dev": dev,
            "test": test,
            "train_target": Path(f"{train}.{target}"),
            "train_trees": ptb / "train.trees",
        },
        record={"treebank": treebank, "silver": silver_counts},
    )


def tune_parse(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    dev: Path,
    decode: DecodeConfig,
    beams: tuple[int, ...],
    alphas: tuple[float, ...],
    out: Path,
    *,
    device: str = "cpu",
    limits: TreeLimits | None = None,
    linearization: str = "words",
) -> tuple[DecodeConfig, dict[str, Any]]:
    """Parse the development set at each beam x alpha and keep the best bracketing F1
    (aiayn's EVALB, COLLINS.prm); a tie goes to the setting listed first. `dev` is the
    prefix of .words and .trees files; the trees parsed stay in `out`. Decoding is
    constrained (`decoding.tree_constraint`), within `limits`."""
    from aiayn.decoding.parse import parse_file
    from aiayn.scoring.evalb import COLLINS
    from aiayn.scoring.evalb import score_files as score_trees_files

    # COLLINS.prm stops after 10 sentences of unequal length; a half-trained model's trees
    # never have that (their words are the input's), but a punctuation tag unlike the gold
    # one does, and choosing a setting must not stop on it
    params = replace(COLLINS, max_error=10**6)
    out.mkdir(parents=True, exist_ok=True)
    tried = []
    for beam in beams or (decode.beam,):
        for alpha in alphas or (decode.alpha,):
            cfg = replace(decode, beam=beam, alpha=alpha, nbest=1)
            hyp = out / f"beam{beam}.alpha{alpha:g}.trees"
            _, summary = parse_file(
                model,
                tokenizer,
                Path(f"{dev}.{SOURCE}"),
                hyp,
                cfg,
                device,
                limits=limits,
                linearization=linearization,
            )
            s = score_trees_files(Path(f"{dev}.trees"), hyp, params).all
            tried.append(
                {
                    "beam": beam,
                    "alpha": alpha,
                    "f1": s.f1,
                    "precision": s.precision,
                    "recall": s.recall,
                    "ill_formed": summary["ill_formed"],
                    "seconds": summary["seconds"],
                    "sentences_per_s": summary["sentences_per_s"],
                }
            )
            log.info("beam %d alpha %g on dev: F1 %.2f", beam, alpha, s.f1)
    best = max(tried, key=lambda r: r["f1"])  # max() keeps the first of equals
    return replace(decode, beam=best["beam"], alpha=best["alpha"]), {
        "criterion": "bracketing F1 (aiayn's EVALB, COLLINS.prm) on the development set",
        "sentences": len(list(read_lines(Path(f"{dev}.{SOURCE}")))),
        "tried": tried,
        "chosen": {"beam": best["beam"], "alpha": best["alpha"]},
    }


def _limits(data: TaskData) -> TreeLimits:
    """The tree constraint's bounds: the training targets' deepest nesting and longest run
    of open brackets (`tree_limits`)."""
    from aiayn.decoding.tree_constraint import TreeLimits, tree_limits

    target = data.files.get("train_target")
    if target is None or not Path(target).is_file():
        return TreeLimits()
    return tree_limits(list(read_lines(Path(target))))


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


class Parsing:
    """The parsing task: see the module docstring."""

    name: str = "parse"
    datasets: tuple[str, ...] = ("ptb",)
    tuning_key: str = "tuning"
    own_fields: frozenset[str] = frozenset(
        {"treebank_split", "linearization", "silver", "silver_ratio", "tune_beam", "evalb"}
    )
    distributed: bool = False
    score_options: frozenset[str] = frozenset({"params", "report"})

    def fetch(
        self, dataset: str, out: Path, source: Path | None, options: dict[str, Any]
    ) -> list[str]:
        """A treebank's splits as trees, words and linearized trees: split by file
        (--split) from a zip or folder, or from one file per split (--train, --dev, --test:
        one-tree-per-line files like 02-21.10way.clean, relative to --from's folder or
        here); without either, NLTK's sample, downloaded and verified."""
        from aiayn.data.download import download_ptb_sample
        from aiayn.parsing.ptb import DOWNLOAD_DIR, prepare_treebank

        refuse_options(dataset, options, ("split", "train", "dev", "test"))
        named = {s: options[s] for s in ("train", "dev", "test") if options.get(s)}
        if named and len(named) < 3:
            missing = [f"--{s}" for s in ("train", "dev", "test") if s not in named]
            raise UsageError(f"{', '.join(missing)} missing: give each split's file, or none")
        if source is not None and not source.exists():
            raise UsageError(f"--from {source}: no such file or directory")
        if source is None and not named:
            source = download_ptb_sample(out / DOWNLOAD_DIR)
        files = None
        if named:
            base = source if source is not None and source.is_dir() else Path(".")
            files = {
                s: Path(f) if Path(f).is_absolute() or Path(f).exists() else base / f
                for s, f in named.items()
            }
            for s, f in files.items():
                if not f.is_file():
                    raise UsageError(f"--{s} {named[s]}: no such file ({f})")
        split = options.get("split") or "auto"
        manifest = prepare_treebank(source, out, split=split, files=files)
        lines = [f"{split}: {json.dumps(info)}" for split, info in manifest["splits"].items()]
        return [*lines, f"{manifest['split']['summary']}; written to {out}"]

    def check(self, recipe: RecipeConfig, where: str) -> None:
        if recipe.treebank_split not in ("auto", "sample", "ldc"):
            raise ConfigError(
                f"{where}: recipe.treebank_split must be 'auto', 'sample' or 'ldc', "
                f"got {recipe.treebank_split!r}"
            )
        if recipe.linearization not in ("gafl", "words"):
            raise ConfigError(
                f"{where}: recipe.linearization must be 'gafl' or 'words', "
                f"got {recipe.linearization!r}"
            )
        if not recipe.silver_ratio > 0:
            raise ConfigError(
                f"{where}: recipe.silver_ratio must be > 0, got {recipe.silver_ratio}"
            )
        if recipe.evalb and not (Path(recipe.evalb) / "evalb.c").is_file():  # not after an hour
            raise ConfigError(
                f"{where}: recipe.evalb = {recipe.evalb!r} holds no evalb.c: give EVALB's source "
                "directory (e.g. ../shared/tools/EVALB), or --set recipe.evalb= to score with "
                "aiayn's scorer alone"
            )

    def prepare(
        self, recipe: RecipeConfig, cfg: Config, out: Path, data: str | Path | None
    ) -> TaskData:
        return prepare_data(recipe, cfg, out, data)

    def tune(
        self, trained: Trained, data: TaskData, decode: DecodeConfig, ctx: RunContext
    ) -> tuple[DecodeConfig, dict[str, Any] | None]:
        import time

        recipe = ctx.recipe
        if not (recipe.tune_beam or recipe.tune_alpha):
            return decode, None
        t0 = time.perf_counter()
        tuned = tune_parse(
            trained.model,
            trained.tokenizer,
            data.files["dev"],
            decode,
            recipe.tune_beam,
            recipe.tune_alpha,
            ctx.out / "tune",
            device=ctx.device,
            limits=_limits(data),
            linearization=recipe.linearization,
        )
        ctx.wall["tune_s"] = time.perf_counter() - t0
        return tuned

    def test(
        self, trained: Trained, data: TaskData, decode: DecodeConfig, ctx: RunContext
    ) -> Outcome:
        import time

        from aiayn.decoding.parse import parse_file
        from aiayn.parsing.trees import right_branching

        out = ctx.out
        test = data.files["test"]
        limits = _limits(data)
        summaries, results = {}, {}
        for mode, suffix in (("constrained", ""), ("unconstrained", ".unconstrained")):
            t0 = time.perf_counter()
            results[mode], summaries[mode] = parse_file(
                trained.model,
                trained.tokenizer,
                Path(f"{test}.{SOURCE}"),
                out / f"test{suffix}.trees",
                decode,
                device=ctx.device,
                raw_path=out / f"test{suffix}.lin",
                constrained=mode == "constrained",
                limits=limits,
                linearization=ctx.recipe.linearization,
            )
            ctx.wall[f"parse_{mode}_s"] = time.perf_counter() - t0
        free = results["unconstrained"]
        norepair = out / "test.norepair.trees"
        write_text_atomic(norepair, "".join(f"{t}\n" for t in free.unrepaired()))
        rightbranch = out / "test.rightbranch.trees"
        write_text_atomic(
            rightbranch, "".join(f"{right_branching(w).to_string()}\n" for w in free.words)
        )
        gold = Path(f"{test}.trees")
        systems = {
            "model": out / "test.trees",
            "model_unconstrained": out / "test.unconstrained.trees",
            "model_without_repairs": norepair,
            "right_branching": rightbranch,
        }
        systems.update(_pcfg_baseline(data, free.words, out))
        scores = _score_all(gold, systems, ctx.recipe.evalb, out / "evalb")
        summary = dict(summaries["constrained"])
        summary["unconstrained"] = summaries["unconstrained"]
        summary["tree_limits"] = {"max_depth": limits.max_depth, "max_opens": limits.max_opens}
        return Outcome(
            scores,
            results={"parse": summary},
            data={
                "test": {
                    "words": sha256_file(Path(f"{test}.{SOURCE}")),
                    "trees": sha256_file(gold),
                }
            },
        )

    def score_files(self, hyp: Path, ref: Path, options: dict[str, Any]) -> Scored:
        """EVALB's bracketing scores, computed by aiayn (`scoring.evalb`), of the trees in
        `hyp` against the gold trees in `ref`; options: params (an EVALB parameter file;
        None: COLLINS.prm's settings)."""
        from aiayn.scoring.evalb import COLLINS, format_report, format_summary, load_params
        from aiayn.scoring.evalb import score_files as score_tree_files

        params = COLLINS if options.get("params") is None else load_params(Path(options["params"]))
        result = score_tree_files(ref, hyp, params)
        return Scored(result.to_dict(), format_summary(result), format_report(result))

    def test_split(self, recipe: RecipeConfig) -> str:
        return "test"

    def label(self, recipe: RecipeConfig) -> str:
        return "parse"

    def format(self, results: dict[str, Any]) -> str:
        return format_parse_results(results)


PARSING = Parsing()
