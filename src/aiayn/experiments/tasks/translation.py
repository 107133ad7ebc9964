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

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import Config, ConfigError, DecodeConfig
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks.base import Outcome, RunContext, Scored, TaskData
from aiayn.files import sha256_file, write_text_atomic

if TYPE_CHECKING:
    from aiayn.decoding.translate import Decoder, SubwordTokenizer
    from aiayn.experiments.stages import Trained

log = logging.getLogger(__name__)

#: WMT14's split names, as `aiayn data wmt14` writes them (newstest2013, newstest2014).
WMT14_SPLITS = ("train", "valid", "test")


def _truncate_copy(src_prefix: Path, langs: list[str], out_prefix: Path, n: int) -> None:
    """Write the first n lines of each PREFIX.LANG[.gz] to OUT_PREFIX.LANG (smoke runs)."""
    from aiayn.data.prepare import find_input
    from aiayn.files import read_lines

    for lang in langs:
        lines = []
        for line in read_lines(find_input(src_prefix, lang)):
            lines.append(line)
            if len(lines) == n:
                break
        write_text_atomic(Path(f"{out_prefix}.{lang}"), "".join(f"{x}\n" for x in lines))


def _line_count(prefix: Path, lang: str) -> int:
    """Lines of PREFIX.LANG[.gz]."""
    from aiayn.data.prepare import find_input
    from aiayn.files import read_lines

    return sum(1 for _ in read_lines(find_input(prefix, lang)))


def _lowercase_copy(src_prefix: Path, langs: list[str], out_prefix: Path) -> None:
    """Write each PREFIX.LANG[.gz] lowercased to OUT_PREFIX.LANG ([recipe] lowercase)."""
    from aiayn.data.prepare import find_input
    from aiayn.files import read_lines

    for lang in langs:
        text = "".join(f"{line.lower()}\n" for line in read_lines(find_input(src_prefix, lang)))
        write_text_atomic(Path(f"{out_prefix}.{lang}"), text)


def _extracted_text(data: Path, splits: list[str], langs: list[str]) -> bool:
    """Whether `data` holds the text itself (SPLIT.LANG[.gz] for every split and side, e.g.
    an `aiayn data wmt14 --out` directory) rather than archives to extract."""
    from aiayn.data.prepare import find_input
    from aiayn.files import InputError

    try:
        for split in splits:
            for lang in langs:
                find_input(data / split, lang)
    except InputError:
        return False
    return True


def _wmt14_raw(recipe: RecipeConfig, out: Path, data: str | Path | None) -> Path:
    """WMT14's text: `data` itself where it holds train/valid/test text (read in place),
    else RUN/data/raw written by `aiayn data wmt14` from the archives (downloaded, or read
    from `data` as a local mirror), each checked against its published hash."""
    from aiayn.data.wmt14 import download_wmt14

    langs = [recipe.source_lang, recipe.target_lang]
    if data is not None and _extracted_text(Path(data), list(WMT14_SPLITS), langs):
        log.info("WMT14 text read in place from %s", data)
        return Path(data)
    other = recipe.target_lang if recipe.source_lang == "en" else recipe.source_lang
    raw = out / "data" / "raw"
    download_wmt14(f"en-{other}", raw, from_dir=data)
    return raw


def prepare_data(recipe: RecipeConfig, cfg: Config, out: Path, data: str | Path | None) -> TaskData:
    """Download (or copy) the corpus, lowercase or truncate it as the recipe asks, prepare.

    TaskData.files: "prefixes" (each split's file prefix, truncated for a smoke run) and
    "full" (before truncation: validation during training reads the whole val set).

    WMT14 is prepared by the streaming prepare (`aiayn.data.stream_prepare`): its 4.5M or
    36M pairs in bounded memory, into memory-mapped arrays that training reads in place."""
    from aiayn.data.download import download_multi30k
    from aiayn.data.prepare import prepare
    from aiayn.data.stream_prepare import prepare_streaming

    src, tgt = recipe.source_lang, recipe.target_lang
    splits = [recipe.train_split, recipe.valid_split, recipe.test_split]
    if recipe.dataset == "wmt14":
        raw = _wmt14_raw(recipe, out, data)
    else:
        raw = out / "data" / "raw"
        download_multi30k(raw, data, splits=splits, langs=[src, tgt])
    prefixes = {s: raw / s for s in splits}
    if recipe.lowercase:
        for split in splits:
            prefixes[split] = out / "data" / f"{split}.lc"
            _lowercase_copy(raw / split, [src, tgt], prefixes[split])
    full = dict(prefixes)  # validation during training reads the whole val set
    tuning = min(recipe.max_test_pairs or recipe.tune_alpha_sentences, recipe.tune_alpha_sentences)
    for split, n in (
        (recipe.train_split, recipe.max_train_pairs),
        (recipe.valid_split, tuning if recipe.tune_alpha else 0),
        (recipe.test_split, recipe.max_test_pairs),
    ):
        if n and _line_count(full[split], src) > n:
            prefixes[split] = out / "data" / f"{split}.first{n}"
            _truncate_copy(full[split], [src, tgt], prefixes[split], n)
    prepared = out / "data" / "prepared"
    if recipe.dataset == "wmt14":
        # tens of minutes of work: a rerun (a resume) reuses it while inputs and settings
        # are the same
        key = _prepare_key(recipe, cfg, [prefixes[recipe.train_split], full[recipe.valid_split]])
        stamp = out / "data" / "prepare_stamp.json"
        done = stamp.is_file() and (prepared / "manifest.json").is_file()
        if done and json.loads(stamp.read_text(encoding="utf-8")) == key:
            log.info("%s: prepared earlier from the same text and settings: reused", prepared)
            manifest = json.loads((prepared / "manifest.json").read_text(encoding="utf-8"))
            return _task_data(prefixes, full, prepared, manifest)
        stamp.unlink(missing_ok=True)
    manifest = (prepare_streaming if recipe.dataset == "wmt14" else prepare)(
        src,
        tgt,
        prefixes[recipe.train_split],
        full[recipe.valid_split],
        None,
        prepared,
        vocab_size=recipe.vocab_size,
        max_len=cfg.train.max_len,
        max_len_ratio=cfg.train.max_len_ratio,
        lowercase=recipe.lowercase,
        model_type=recipe.vocab_model,
    )
    if recipe.dataset == "wmt14":
        write_text_atomic(stamp, json.dumps(key, indent=1) + "\n")
    return _task_data(prefixes, full, prepared, manifest)


def _task_data(
    prefixes: dict[str, Path], full: dict[str, Path], prepared: Path, manifest: dict[str, Any]
) -> TaskData:
    return TaskData(
        prepared,
        manifest,
        files={"prefixes": prefixes, "full": full},
        record={"inputs": manifest["inputs"]},
    )


def _prepare_key(recipe: RecipeConfig, cfg: Config, prefixes: list[Path]) -> dict[str, Any]:
    """What a prepared directory depends on: the settings, and each input file's path,
    size and modification time (hashing 10 GB of text again would take minutes)."""
    from aiayn.data.prepare import find_input

    files = {}
    for prefix in prefixes:
        for lang in (recipe.source_lang, recipe.target_lang):
            path = find_input(prefix, lang)
            st = path.stat()
            files[str(path.resolve())] = [st.st_size, st.st_mtime_ns]
    return {
        "vocab_size": recipe.vocab_size,
        "vocab_model": recipe.vocab_model,
        "lowercase": recipe.lowercase,
        "max_train_pairs": recipe.max_train_pairs,
        "max_len": cfg.train.max_len,
        "max_len_ratio": cfg.train.max_len_ratio,
        "files": files,
    }


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


#: The training steps that the En->De recipe's model needs to score well above
#: UNUSABLE_BLEU (about what a 2-core Sapphire Rapids VM trains in 10 minutes of bf16).
USABLE_STEPS = 2500


def not_trained_enough(
    bleu: float, train: dict[str, Any], max_minutes: float, dtype: str
) -> dict[str, Any] | None:
    """None for a usable model; else what results.json and the summary say of one whose
    test BLEU is near 0: how far it trained, how fast on this CPU, and the budget that
    would reach `USABLE_STEPS` at that pace."""
    if bleu >= UNUSABLE_BLEU:
        return None
    from aiayn.fast import machine

    steps, seconds = int(train["steps"]), float(train["train_seconds"])
    minutes = seconds / 60
    rate = train["tokens"] / max(seconds, 1e-9)
    need = math.ceil(minutes * USABLE_STEPS / max(steps, 1) / 5) * 5 if steps else None
    cls = machine.cpu().cls
    advice = (
        f"try MINUTES={need} (bash scripts/quickstart.sh) or --max-minutes {need}"
        if need and need > minutes
        else "train longer (--max-minutes) or check the data"
    )
    message = (
        f"not trained enough: {steps} steps in {minutes:.1f} minutes at {rate:,.0f} tokens/s "
        f"on this CPU (class {cls}, training in {dtype}); test sacreBLEU "
        f"{bleu:.2f} is below {UNUSABLE_BLEU:g}, {advice}"
    )
    return {
        "message": message,
        "steps": steps,
        "train_minutes": minutes,
        "tokens_per_s": rate,
        "cpu_class": cls,
        "dtype": dtype,
        "budget_minutes": max_minutes,
        "suggested_minutes": need,
    }


#: Validation sentences decoded first, at the grid's first alpha, before tuning the length
#: penalty: a model below UNUSABLE_BLEU there is reported as not trained enough instead of
#: being decoded once per alpha (an undertrained model's outputs run to the length cap).
ALPHA_SCREEN_SENTENCES = 100
#: sacreBLEU below which a model counts as not usable (untrained models score 0-0.5).
UNUSABLE_BLEU = 1.0


def tune_alpha(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    src_path: Path,
    ref_path: Path,
    target_lang: str,
    decode: DecodeConfig,
    grid: tuple[float, ...],
    out: Path,
    *,
    device: str = "cpu",
    screen: int = ALPHA_SCREEN_SENTENCES,
) -> tuple[DecodeConfig, dict[str, Any]]:
    """Translate the validation set at each length penalty in `grid` and keep the best.

    The criterion is sacreBLEU; a tie goes to the value listed first. The hypotheses stay
    in `out` (one file per alpha) for inspection. Where the set has more than `screen`
    sentences, its first `screen` are decoded at grid[0] first, and a model scoring below
    `UNUSABLE_BLEU` there keeps `decode`'s alpha: the record says "skipped".

    Returns:
        The decode settings with the chosen alpha, and a record of every alpha's scores.
    """
    from aiayn.decoding.translate import translate_file
    from aiayn.files import read_lines
    from aiayn.scoring.bleu import score_files

    if not grid:
        raise ValueError("tune_alpha needs at least one alpha to try")
    out.mkdir(parents=True, exist_ok=True)
    if screen:
        src_lines = list(read_lines(src_path))
        if len(src_lines) > screen:
            ref_lines = list(read_lines(ref_path))[:screen]
            first = {"src": src_lines[:screen], "ref": ref_lines}
            for side, lines in first.items():
                write_text_atomic(out / f"screen.{side}", "".join(f"{x}\n" for x in lines))
            cfg = replace(decode, alpha=grid[0])
            hyp = out / "screen.hyp"
            summary = translate_file(model, tokenizer, out / "screen.src", hyp, cfg, device=device)
            s = score_files(hyp, out / "screen.ref", target_lang)
            record = {
                "sentences": screen,
                "alpha": grid[0],
                "sacrebleu": s.sacrebleu,
                "tok_bleu": s.tok_bleu,
                "seconds": summary["seconds"],
            }
            if s.sacrebleu < UNUSABLE_BLEU:
                log.warning(
                    "alpha tuning skipped: sacreBLEU %.2f on the first %d sentences of %s "
                    "at alpha %g, below %g: the model is not trained enough to tune",
                    s.sacrebleu,
                    screen,
                    src_path.name,
                    grid[0],
                    UNUSABLE_BLEU,
                )
                return decode, {
                    "criterion": "sacrebleu",
                    "skipped": "model not usable",
                    "screen": record,
                    "sentences": 0,
                    "tried": [],
                    "chosen": decode.alpha,
                }
    tried = []
    for alpha in grid:
        cfg = replace(decode, alpha=alpha)
        hyp = out / f"alpha{alpha:g}.hyp"
        summary = translate_file(model, tokenizer, src_path, hyp, cfg, device=device)
        s = score_files(hyp, ref_path, target_lang)
        tried.append(
            {
                "alpha": alpha,
                "sacrebleu": s.sacrebleu,
                "tok_bleu": s.tok_bleu,
                "chrf": s.chrf,
                "seconds": summary["seconds"],
            }
        )
        log.info(
            "alpha %g on %s: sacreBLEU %.2f, tok-BLEU %.2f",
            alpha,
            src_path.name,
            s.sacrebleu,
            s.tok_bleu,
        )
    best = max(tried, key=lambda r: r["sacrebleu"])  # max() keeps the first of equals
    return replace(decode, alpha=best["alpha"]), {
        "criterion": "sacrebleu",
        "sentences": s.n_lines,
        "tried": tried,
        "chosen": best["alpha"],
    }


def format_results(results: dict[str, Any]) -> str:
    """Every BLEU convention side by side, with signatures, for the terminal."""
    s = results["scores"]
    t = results["train"]
    f = results["flops"]
    k = results.get("ensemble", 1)
    models = (
        f"an ensemble of {k} models, each the average of {len(results['averaged'])} "
        f"checkpoints, {results['parameters']:,} params each"
        if k > 1
        else f"average of {len(results['averaged'])} checkpoints, {results['parameters']:,} params"
    )
    lines = [
        f"{results['pair']} {results['test_split']} ({s['n_lines']} sentences), {models}",
        f"  sacreBLEU         {s['sacrebleu']:6.2f}  {s['sacrebleu_signature']}",
        f"  tok-BLEU (lc)     {s['tok_bleu']:6.2f}  {s['tok_bleu_signature']}",
        f"  chrF2             {s['chrf']:6.2f}  {s['chrf_signature']}",
        *(
            [
                f"  paper             {s['paper_bleu']:6.2f}  {s['paper_bleu_signature']}",
                "                    (Table 2's convention: cased, Moses-tokenized"
                + (
                    ", compounds split at ##AT##)"
                    if "compound-split" in s["paper_bleu_signature"]
                    else ")"
                ),
            ]
            if "paper_bleu" in s
            else []
        ),
        f"  training: {t['steps']} steps, {t['epochs']} epochs, {t['train_seconds'] / 60:.1f} min,"
        f" {t['tokens'] / max(t['train_seconds'], 1e-9):,.0f} tokens/s ({t['stopped_by']})",
        f"  FLOPs: {f['counted_from_model']:.3g} counted, "
        f"{f['estimated_time_x_devices_x_peak']:.3g} as time x peak "
        f"({f['sustained_peak_flop_s'] / 1e12:.2f} TFLOP/s {f['peak_dtype']})",
    ]
    for m in t.get("members", []):
        ms = m["scores"]
        lines.append(
            f"  {m['run']} (seed {m['seed']}) alone: sacreBLEU {ms['sacrebleu']:.2f}, "
            f"tok-BLEU {ms['tok_bleu']:.2f}, chrF2 {ms['chrf']:.2f}; {m['steps']} steps"
        )
    tuning = results.get("alpha_tuning")
    if tuning and tuning.get("skipped"):
        sc = tuning["screen"]
        lines.insert(
            1,
            f"  beam {results['config']['decode']['beam']}, alpha {tuning['chosen']:g}: "
            f"tuning skipped, sacreBLEU {sc['sacrebleu']:.2f} on the first {sc['sentences']} "
            f"sentences of {tuning['split']}",
        )
    elif tuning:
        tried = ", ".join(f"{r['alpha']:g}: {r['sacrebleu']:.2f}" for r in tuning["tried"])
        lines.insert(
            1,
            f"  beam {results['config']['decode']['beam']}, alpha "
            f"{tuning['chosen']:g} chosen on {tuning['split']} "
            f"({tuning['sentences']} sentences; sacreBLEU by alpha {tried})",
        )
    if results.get("not_trained_enough"):
        lines.append(f"  WARNING: {results['not_trained_enough']['message']}")
    if results.get("recipe", {}).get("lowercase"):
        lines.insert(
            1,
            "  lowercased data (recipe.lowercase): every score is against the "
            "lowercased references",
        )
    return "\n".join(lines)


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
