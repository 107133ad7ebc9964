"""Translation's data stage: Multi30k copied or downloaded (WMT14 from `aiayn data
wmt14`, prepared streaming), each file checked against its sha256, lowercased or truncated as
the recipe asks, and prepared once (a stamp of the settings and inputs skips a rerun)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from aiayn.config import Config
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks.base import TaskData
from aiayn.files import write_text_atomic

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
