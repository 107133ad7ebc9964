"""Translation (sections 5 and 6.1): parallel text in, BLEU out.

The task's stages of `aiayn recipe` (`aiayn.experiments.tasks.base`):

    prepare   Multi30k copied or downloaded (WMT14: `aiayn data wmt14`, prepared streaming),
              each file checked against its sha256; lowercased or truncated as the recipe asks
    tune      the length penalty alpha chosen on the validation set (`recipe.tune_alpha`)
    test      the test set translated with beam search, scored by sacreBLEU, tok-BLEU, chrF
              and Table 2's convention; an ensemble's members also alone

Files in RUN: data/raw/, data/prepared/, tune_alpha/ (one hypothesis file per alpha),
TEST.SRC-TGT.hyp, and memberK/TEST.SRC-TGT.hyp for an ensemble.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import Config, ConfigError, DecodeConfig
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks.base import Outcome, RunContext, Scored, TaskData, refuse_options
from aiayn.experiments.tasks.translation.data import WMT14_SPLITS, prepare_data
from aiayn.experiments.tasks.translation.report import format_results
from aiayn.experiments.tasks.translation.tuning import (
    UNUSABLE_BLEU,
    USABLE_STEPS,
    not_trained_enough,
    tune_alpha,
)
from aiayn.files import UsageError, sha256_file

if TYPE_CHECKING:
    from aiayn.experiments.stages import Trained

__all__ = [
    "TRANSLATION",
    "UNUSABLE_BLEU",
    "USABLE_STEPS",
    "WMT14_SPLITS",
    "Translation",
    "format_results",
    "not_trained_enough",
    "prepare_data",
    "tune_alpha",
]

log = logging.getLogger(__name__)


def _member_scores(
    runs: list[Path],
    models: list[Any],
    trained: list[dict[str, Any]],
    averaged: list[list[str]],
    translate: Any,
    hyp_name: str,
) -> list[dict[str, Any]]:
    """Each ensemble member's own test scores, at the ensemble's settings: what the
    ensemble adds. `translate(model, hyp_path)` translates the test set and scores it."""
    members = []
    for run, member, t, names in zip(runs, models, trained, averaged, strict=True):
        members.append(
            {
                "run": run.name,
                **t,
                "averaged": names,
                "scores": translate(member, run / hyp_name).to_dict(),
            }
        )
    return members


class Translation:
    """The translation task: see the module docstring."""

    name: str = "translate"
    datasets: tuple[str, ...] = ("multi30k", "wmt14")
    tuning_key: str = "alpha_tuning"
    own_fields: frozenset[str] = frozenset(
        {
            "source_lang",
            "target_lang",
            "train_split",
            "valid_split",
            "test_split",
            "tune_alpha_sentences",
            "lowercase",
            "vocab_model",
        }
    )
    distributed: bool = True
    score_options: frozenset[str] = frozenset({"lang", "bootstrap"})

    def fetch(
        self, dataset: str, out: Path, source: Path | None, options: dict[str, Any]
    ) -> list[str]:
        """multi30k: the raw files (--splits, --langs: subsets), each against its pinned
        sha256; wmt14: the paper's pair (--pair, required) as aligned text."""
        if dataset == "wmt14":
            from aiayn.data.wmt14 import download_wmt14

            refuse_options(dataset, options, ("pair",))
            if options.get("pair") is None:
                raise UsageError("wmt14 needs --pair en-de or --pair en-fr")
            stamp = download_wmt14(options["pair"], out, source)
            lines = [f"{split}: {info['lines']} pairs" for split, info in stamp["splits"].items()]
            where = f"{out} (sources and counts: {out}/wmt14.json)"
            return [*lines, f"WMT14 {options['pair']} in {where}"]
        from aiayn.data.download import download_multi30k

        refuse_options(dataset, options, ("splits", "langs"))
        kwargs = {k: options[k].split(",") for k in ("splits", "langs") if options.get(k)}
        paths = download_multi30k(out, source, **kwargs)
        return [f"{len(paths)} files in {out}"]

    def check(self, recipe: RecipeConfig, where: str) -> None:
        if recipe.vocab_model not in ("bpe", "unigram"):
            raise ConfigError(
                f"{where}: recipe.vocab_model must be 'bpe' or 'unigram', "
                f"got {recipe.vocab_model!r}"
            )
        if recipe.dataset == "wmt14":
            langs = {recipe.source_lang, recipe.target_lang}
            if langs not in ({"en", "de"}, {"en", "fr"}):
                raise ConfigError(
                    f"{where}: WMT14 has en-de and en-fr (either direction), not "
                    f"{recipe.source_lang}-{recipe.target_lang}"
                )
            splits = (recipe.train_split, recipe.valid_split, recipe.test_split)
            if splits != WMT14_SPLITS:
                raise ConfigError(
                    f"{where}: WMT14's splits are train_split = 'train', valid_split = 'valid' "
                    f"(newstest2013), test_split = 'test' (newstest2014), got {splits}"
                )

    def prepare(
        self, recipe: RecipeConfig, cfg: Config, out: Path, data: str | Path | None
    ) -> TaskData:
        return prepare_data(recipe, cfg, out, data)

    def tune(
        self, trained: Trained, data: TaskData, decode: DecodeConfig, ctx: RunContext
    ) -> tuple[DecodeConfig, dict[str, Any] | None]:
        import time

        from aiayn.data.prepare import find_input

        recipe = ctx.recipe
        if not recipe.tune_alpha:
            return decode, None
        t0 = time.perf_counter()
        valid = [
            find_input(data.files["prefixes"][recipe.valid_split], lang)
            for lang in (recipe.source_lang, recipe.target_lang)
        ]
        decode, tuning = tune_alpha(
            trained.model,
            trained.tokenizer,
            valid[0],
            valid[1],
            recipe.target_lang,
            decode,
            recipe.tune_alpha,
            ctx.out / "tune_alpha",
            device=ctx.device,
        )
        tuning["split"] = recipe.valid_split
        ctx.wall["tune_alpha_s"] = time.perf_counter() - t0
        return decode, tuning

    def test(
        self, trained: Trained, data: TaskData, decode: DecodeConfig, ctx: RunContext
    ) -> Outcome:
        import time

        from aiayn.data.prepare import find_input
        from aiayn.decoding.translate import translate_file
        from aiayn.scoring.bleu import score_files
        from aiayn.training.precision import resolve_dtype

        recipe, device, wall = ctx.recipe, ctx.device, ctx.wall
        src, tgt = recipe.source_lang, recipe.target_lang
        clock = time.perf_counter
        t0 = clock()
        test_src, test_ref = (
            find_input(data.files["prefixes"][recipe.test_split], lang) for lang in (src, tgt)
        )
        hyp = ctx.out / f"{recipe.test_split}.{src}-{tgt}.hyp"
        tokenizer = trained.tokenizer
        summary = translate_file(trained.model, tokenizer, test_src, hyp, decode, device=device)
        wall["translate_s"] = clock() - t0
        scores = score_files(hyp, test_ref, tgt)
        train: dict[str, Any] = {}
        if len(trained.runs) > 1:
            t0 = clock()

            def translate_and_score(member: Any, member_hyp: Path) -> Any:
                translate_file(member, tokenizer, test_src, member_hyp, decode, device=device)
                return score_files(member_hyp, test_ref, tgt)

            train["members"] = _member_scores(
                trained.runs,
                trained.models,
                trained.trained,
                trained.averaged,
                translate_and_score,
                hyp.name,
            )
            wall["translate_members_s"] = clock() - t0
        results: dict[str, Any] = {"pair": f"{src}-{tgt}", "translate": summary}
        flag = not_trained_enough(
            scores.sacrebleu,
            ctx.train,
            ctx.cfg.train.max_minutes,
            resolve_dtype(ctx.cfg.train.dtype, device),
        )
        if flag is not None:
            results["not_trained_enough"] = flag
            log.warning("%s", flag["message"])
        return Outcome(
            scores.to_dict(),
            results=results,
            train=train,
            data={"test": {"src": sha256_file(test_src), "tgt": sha256_file(test_ref)}},
        )

    def score_files(self, hyp: Path, ref: Path, options: dict[str, Any]) -> Scored:
        """sacreBLEU, tok-BLEU, chrF and Table 2's convention (`scoring.bleu`); options:
        lang (the target language; None: from the reference's suffix), bootstrap (N
        resamples for BLEU's 95% interval; 0 or None: none)."""
        from aiayn.scoring.bleu import score_files

        s = score_files(hyp, ref, options.get("lang"), bootstrap=options.get("bootstrap") or 0)
        return Scored(s.to_dict(), s.format())

    def test_split(self, recipe: RecipeConfig) -> str:
        return recipe.test_split

    def label(self, recipe: RecipeConfig) -> str:
        return f"{recipe.source_lang}-{recipe.target_lang}"

    def format(self, results: dict[str, Any]) -> str:
        return format_results(results)


TRANSLATION = Translation()
