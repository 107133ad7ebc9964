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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import Config, ConfigError, DecodeConfig
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks.base import Outcome, RunContext, Scored, TaskData, refuse_options
from aiayn.experiments.tasks.parsing.data import SOURCE, _limits, mix_silver, prepare_data
from aiayn.experiments.tasks.parsing.scores import (
    _pcfg_baseline,
    _score_all,
    format_parse_results,
)
from aiayn.experiments.tasks.parsing.tuning import tune_parse
from aiayn.files import UsageError, sha256_file, write_text_atomic

if TYPE_CHECKING:
    from aiayn.experiments.stages import Trained

log = logging.getLogger(__name__)


__all__ = [
    "PARSING",
    "SOURCE",
    "Parsing",
    "format_parse_results",
    "mix_silver",
    "prepare_data",
    "tune_parse",
]


class Parsing:
    """The parsing task: see the module docstring."""

    name: str = "parse"
    datasets: tuple[str, ...] = ("ptb",)
    tuning_key: str = "tuning"
    own_fields: frozenset[str] = frozenset(
        {
            "treebank_split",
            "linearization",
            "word_mass",
            "silver",
            "silver_ratio",
            "tune_beam",
            "evalb",
        }
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
            word_mass=recipe.word_mass,
        )
        ctx.wall["tune_s"] = time.perf_counter() - t0
        return tuned

    def test(
        self, trained: Trained, data: TaskData, decode: DecodeConfig, ctx: RunContext
    ) -> Outcome:
        import time

        from aiayn.decoding.parse import parse_file
        from aiayn.parsing.linearize import right_branching

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
                word_mass=ctx.recipe.word_mass,
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
