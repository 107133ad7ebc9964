"""A recipe: one experiment file run end to end, data to BLEU, with a manifest of the run.

data -> prepare -> train -> average -> translate the test set -> evaluate (section 5, 6.1),
each stage writing files into one run directory:

    RUN/data/raw/        the downloaded (or copied) corpus, verified by sha256
    RUN/data/prepared/   subword model, id tensors, manifest
    RUN/checkpoint_*.pt  training checkpoints (resumable: rerunning continues)
    RUN/checkpoint_avg.pt  the average of the last K checkpoints
    RUN/tune_alpha/      the validation set translated at each length penalty tried
    RUN/test.hyp         the translated test set
    RUN/results.json     scores with signatures, and the run's manifest

The experiment file is a preset plus overrides (see `config.load_experiment`) and a
[recipe] table for what is not a model, training or decoding setting.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aiayn.config import (
    Config,
    ConfigError,
    DecodeConfig,
    apply_overrides,
    coerce_value,
    load_experiment,
)
from aiayn.files import sha256_file, write_text_atomic
from aiayn.train import Hooks

if TYPE_CHECKING:
    from aiayn.model import Transformer
    from aiayn.translate import SubwordTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecipeConfig:
    """The [recipe] table of an experiment file."""

    dataset: str = "multi30k"
    source_lang: str = "en"
    target_lang: str = "de"
    vocab_size: int = 8000
    train_split: str = "train"
    valid_split: str = "val"
    test_split: str = "test_2016_flickr"
    average_last: int = 5  # checkpoints averaged (section 6.1: 5 for base, 20 for big)
    max_train_pairs: int = 0  # 0 = all; a smaller number makes a quick smoke run
    max_test_pairs: int = 0  # 0 = all; likewise for the test set (and the tune_alpha sentences)
    # Length penalties tried on the validation set once training is done; the one with the
    # best sacreBLEU decodes the test set. Section 6.1: beam size and alpha "were chosen
    # after experimentation on the development set". Empty: decode.alpha as configured.
    tune_alpha: tuple[float, ...] = ()
    # Train, translate and score lowercased text, as many published Multi30k systems do
    # (trained on the shared task's lowercased, tokenized files, scored on lowercased
    # text). The vocabulary lowercases what it encodes, so the checkpoint lowercases any
    # input it translates. Off by default: the translations then have no capitals, and
    # sacreBLEU is computed against lowercased references.
    lowercase: bool = False


def parse_recipe(table: dict[str, Any], where: str) -> RecipeConfig:
    """The [recipe] table as a RecipeConfig; an unknown key is an error naming the closest."""
    import difflib

    names = {f.name: f for f in fields(RecipeConfig)}
    for key in table:
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key recipe.{key!r}{hint}")
    if "tune_alpha" in table:
        grid = table["tune_alpha"]
        if not isinstance(grid, list | tuple) or not all(
                isinstance(a, int | float) and not isinstance(a, bool) and a >= 0 for a in grid):
            raise ConfigError(f"{where}: recipe.tune_alpha must be a list of numbers >= 0, "
                              f"got {grid!r}")
        table = {**table, "tune_alpha": tuple(float(a) for a in grid)}
    recipe = RecipeConfig(**table)
    if recipe.dataset != "multi30k":
        raise ConfigError(f"{where}: recipe.dataset must be 'multi30k', got {recipe.dataset!r}")
    if (recipe.average_last < 1 or recipe.vocab_size < 10 or recipe.max_train_pairs < 0
            or recipe.max_test_pairs < 0):
        raise ConfigError(f"{where}: recipe.average_last >= 1, vocab_size >= 10, "
                          "max_train_pairs >= 0 and max_test_pairs >= 0 are required")
    return recipe


def type_like(cls: type, key: str, value: Any) -> Any:
    """A --set string as the type of the RecipeConfig field it sets."""
    name = key.removeprefix("recipe.")
    default = {f.name: f.default for f in fields(cls)}.get(name)
    if isinstance(default, tuple) and isinstance(value, str):  # "0.6,1.0" -> [0.6, 1.0]
        try:
            return [float(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"{key} must be comma-separated numbers, got {value!r}") from None
    if isinstance(default, bool) and isinstance(value, str):
        return coerce_value(key, default, value)
    if isinstance(default, int) and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {value!r}") from None
    return value


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None
                ) -> tuple[Config, RecipeConfig]:
    """Read an experiment file with a [recipe] table; `overrides` are --set values."""
    cfg, extra = load_experiment(path)
    unknown = set(extra) - {"recipe"}
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}")
    overrides = dict(overrides or {})
    table = dict(extra.get("recipe", {}))
    for key in [k for k in overrides if k.startswith("recipe.")]:
        table[key.removeprefix("recipe.")] = type_like(RecipeConfig, key, overrides.pop(key))
    recipe = parse_recipe(table, str(path))
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    if cfg.train.keep_last < recipe.average_last:
        raise ConfigError(f"{path}: train.keep_last ({cfg.train.keep_last}) must be at least "
                          f"recipe.average_last ({recipe.average_last})")
    return cfg, recipe


def _truncate_copy(src_prefix: Path, langs: list[str], out_prefix: Path, n: int) -> None:
    """Write the first n lines of each PREFIX.LANG[.gz] to OUT_PREFIX.LANG (smoke runs)."""
    from aiayn.data import find_input
    from aiayn.files import read_lines

    for lang in langs:
        lines = []
        for line in read_lines(find_input(src_prefix, lang)):
            lines.append(line)
            if len(lines) == n:
                break
        write_text_atomic(Path(f"{out_prefix}.{lang}"), "".join(f"{x}\n" for x in lines))


def _lowercase_copy(src_prefix: Path, langs: list[str], out_prefix: Path) -> None:
    """Write each PREFIX.LANG[.gz] lowercased to OUT_PREFIX.LANG ([recipe] lowercase)."""
    from aiayn.data import find_input
    from aiayn.files import read_lines

    for lang in langs:
        text = "".join(f"{line.lower()}\n" for line in read_lines(find_input(src_prefix, lang)))
        write_text_atomic(Path(f"{out_prefix}.{lang}"), text)


def environment() -> dict[str, Any]:
    """Library versions and machine, for the manifest."""
    versions: dict[str, str | None] = {}
    for name in ("aiayn", "torch", "sentencepiece", "sacrebleu", "sacremoses", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import os

    machine: dict[str, Any] = {"platform": platform.platform(), "processor": _cpu_name(),
                               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                               "python": sys.version.split()[0], **cpu_kernels()}
    if torch.cuda.is_available():
        machine["cuda_devices"] = [torch.cuda.get_device_name(i)
                                   for i in range(torch.cuda.device_count())]
    return {"versions": versions, "machine": machine}


def cpu_kernels() -> dict[str, Any]:
    """Which vector units PyTorch and oneDNN use on this CPU.

    They choose oneDNN's kernels, and so how a bf16 run's sums round: the same seed
    reproduced bit for bit on Sapphire Rapids VMs (AMX) and gave another run, 0.31-0.34
    BLEU apart, on an AVX-512 BF16 CPU without AMX (AMD EPYC; docs/results.md).
    """
    flags = set(_cpuinfo("flags").split())
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}


def _cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor()


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def run_recipe(path: str | Path, out: str | Path, *, data: str | Path | None = None,
               device: str = "cpu", overrides: dict[str, Any] | None = None,
               hooks: Hooks | None = None) -> dict[str, Any]:
    """Run an experiment file end to end; see the module docstring for the files it writes.

    Args:
        path: the experiment file (TOML) with a [recipe] table.
        out: the run directory; rerunning resumes training and redoes the later stages.
        data: a local copy of the corpus (e.g. ../shared/data/multi30k); None downloads it.
        device: "cpu", "cuda", ...
        overrides: config keys to change (as `--set`), e.g. {"train.max_minutes": 60}.
        hooks: training callbacks (the CLI's progress bar).

    Returns:
        The results dictionary also written to RUN/results.json.
    """
    from aiayn.checkpoint import (
        average_checkpoints,
        list_last,
        load_model,
        save_checkpoint_file,
    )
    from aiayn.curves import plot_curves, read_log
    from aiayn.data import find_input, prepare
    from aiayn.download import download_multi30k
    from aiayn.evaluate import score_files
    from aiayn.flops import cpu_matmul_rates, matmul_peak, slow_bf16_warning
    from aiayn.train import train
    from aiayn.translate import translate_file

    cfg, recipe = load_recipe(path, overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src, tgt = recipe.source_lang, recipe.target_lang
    wall: dict[str, float] = {}

    t0 = time.perf_counter()
    raw = out / "data" / "raw"
    splits = [recipe.train_split, recipe.valid_split, recipe.test_split]
    download_multi30k(raw, data, splits=splits, langs=[src, tgt])
    prefixes = {s: raw / s for s in splits}
    if recipe.lowercase:
        for split in splits:
            prefixes[split] = out / "data" / f"{split}.lc"
            _lowercase_copy(raw / split, [src, tgt], prefixes[split])
    full = dict(prefixes)  # validation during training reads the whole val set
    for split, n in ((recipe.train_split, recipe.max_train_pairs),
                     (recipe.valid_split, recipe.max_test_pairs if recipe.tune_alpha else 0),
                     (recipe.test_split, recipe.max_test_pairs)):
        if n:
            prefixes[split] = out / "data" / f"{split}.first{n}"
            _truncate_copy(full[split], [src, tgt], prefixes[split], n)
    prepared = out / "data" / "prepared"
    manifest = prepare(src, tgt, prefixes[recipe.train_split], full[recipe.valid_split],
                       None, prepared, vocab_size=recipe.vocab_size,
                       max_len=cfg.train.max_len, max_len_ratio=cfg.train.max_len_ratio,
                       lowercase=recipe.lowercase)
    wall["data_and_prepare_s"] = time.perf_counter() - t0

    # The matmul ceiling for Table 2's estimate, measured before training (measured after
    # it in the same process, it came out 2-3x lower on the CPU).
    peak_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
    if cfg.train.dtype == "bf16" and slow_bf16_warning(device):
        # emulated bf16 (the trainer says so next): the 2048^3 products would take minutes
        peak = cpu_matmul_rates()[1]
    else:
        peak = matmul_peak(peak_dtype, device=device)
    t0 = time.perf_counter()
    result = train(cfg, prepared, out, device=device, hooks=hooks)
    wall["train_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    paths = list_last(out, recipe.average_last, strict=False)
    save_checkpoint_file(out / "checkpoint_avg.pt", average_checkpoints(paths))
    model, tokenizer, avg_cfg = load_model(out / "checkpoint_avg.pt", device=device)
    wall["average_s"] = time.perf_counter() - t0

    decode, tuning = cfg.decode, None
    if recipe.tune_alpha:
        t0 = time.perf_counter()
        valid = [find_input(prefixes[recipe.valid_split], lang) for lang in (src, tgt)]
        decode, tuning = tune_alpha(model, tokenizer, valid[0], valid[1], tgt, cfg.decode,
                                    recipe.tune_alpha, out / "tune_alpha", device=device)
        tuning["split"] = recipe.valid_split
        wall["tune_alpha_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    test_src, test_ref = (find_input(prefixes[recipe.test_split], lang) for lang in (src, tgt))
    hyp = out / f"{recipe.test_split}.{src}-{tgt}.hyp"
    summary = translate_file(model, tokenizer, test_src, hyp, decode, device=device)
    wall["translate_s"] = time.perf_counter() - t0
    scores = score_files(hyp, test_ref, tgt)

    state = result.state
    results = {
        "experiment": str(path), "test_split": recipe.test_split, "pair": f"{src}-{tgt}",
        "scores": scores.to_dict(),
        "averaged": [p.name for p in paths],
        "train": {"steps": state.step, "epochs": state.epoch, "tokens": state.tokens_seen,
                  "train_seconds": state.train_seconds, "stopped_by": result.stopped_by,
                  "best_valid_nll": state.best_valid_nll,
                  "last_valid": next((h for h in reversed(read_log(out)) if "valid_nll" in h),
                                     None)},
        "flops": {"counted_from_model": state.flops,
                  "estimated_time_x_devices_x_peak": state.train_seconds * peak,
                  "sustained_peak_flop_s": peak, "peak_dtype": str(peak_dtype),
                  "model_flop_s": state.flops / max(state.train_seconds, 1e-9)},
        "wall_seconds": wall, "translate": summary, "alpha_tuning": tuning,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": cfg.train.seed, "recipe": asdict(recipe),
        # the decode settings the test set was translated with (alpha as tuned)
        "config": replace(avg_cfg, decode=decode).to_dict(),
        "data": {"prepared_manifest_sha256": sha256_file(prepared / "manifest.json"),
                 "vocab_sha256": manifest["spm_model"]["sha256"],
                 "inputs": manifest["inputs"],
                 "test": {"src": sha256_file(test_src), "tgt": sha256_file(test_ref)}},
        **environment(),
    }
    write_text_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    try:
        plot_curves({f"{src}-{tgt}": out}, out / "curve.png", title=str(path))
    except ImportError:
        log.info("matplotlib is not installed (pip install 'aiayn[plot]'): no curve.png")
    return results


def tune_alpha(model: Transformer, tokenizer: SubwordTokenizer, src_path: Path, ref_path: Path,
               target_lang: str, decode: DecodeConfig, grid: tuple[float, ...], out: Path, *,
               device: str = "cpu") -> tuple[DecodeConfig, dict[str, Any]]:
    """Translate the validation set at each length penalty in `grid` and keep the best.

    The criterion is sacreBLEU; a tie goes to the value listed first. The hypotheses stay
    in `out` (one file per alpha) for inspection.

    Returns:
        The decode settings with the chosen alpha, and a record of every alpha's scores.
    """
    from aiayn.evaluate import score_files
    from aiayn.translate import translate_file

    if not grid:
        raise ValueError("tune_alpha needs at least one alpha to try")
    out.mkdir(parents=True, exist_ok=True)
    tried = []
    for alpha in grid:
        cfg = replace(decode, alpha=alpha)
        hyp = out / f"alpha{alpha:g}.hyp"
        summary = translate_file(model, tokenizer, src_path, hyp, cfg, device=device)
        s = score_files(hyp, ref_path, target_lang)
        tried.append({"alpha": alpha, "sacrebleu": s.sacrebleu, "tok_bleu": s.tok_bleu,
                      "chrf": s.chrf, "seconds": summary["seconds"]})
        log.info("alpha %g on %s: sacreBLEU %.2f, tok-BLEU %.2f", alpha, src_path.name,
                 s.sacrebleu, s.tok_bleu)
    best = max(tried, key=lambda r: r["sacrebleu"])  # max() keeps the first of equals
    return replace(decode, alpha=best["alpha"]), {
        "criterion": "sacrebleu", "sentences": s.n_lines, "tried": tried,
        "chosen": best["alpha"]}


def format_results(results: dict[str, Any]) -> str:
    """Every BLEU convention side by side, with signatures, for the terminal."""
    s = results["scores"]
    t = results["train"]
    f = results["flops"]
    lines = [
        f"{results['pair']} {results['test_split']} ({s['n_lines']} sentences), "
        f"average of {len(results['averaged'])} checkpoints, {results['parameters']:,} params",
        f"  sacreBLEU         {s['sacrebleu']:6.2f}  {s['sacrebleu_signature']}",
        f"  tok-BLEU (lc)     {s['tok_bleu']:6.2f}  {s['tok_bleu_signature']}",
        f"  chrF2             {s['chrf']:6.2f}  {s['chrf_signature']}",
        f"  training: {t['steps']} steps, {t['epochs']} epochs, {t['train_seconds'] / 60:.1f} min,"
        f" {t['tokens'] / max(t['train_seconds'], 1e-9):,.0f} tokens/s ({t['stopped_by']})",
        f"  FLOPs: {f['counted_from_model']:.3g} counted, "
        f"{f['estimated_time_x_devices_x_peak']:.3g} as time x peak "
        f"({f['sustained_peak_flop_s'] / 1e12:.2f} TFLOP/s {f['peak_dtype']})",
    ]
    tuning = results.get("alpha_tuning")
    if tuning:
        tried = ", ".join(f"{r['alpha']:g}: {r['sacrebleu']:.2f}" for r in tuning["tried"])
        lines.insert(1, f"  beam {results['config']['decode']['beam']}, alpha "
                        f"{tuning['chosen']:g} chosen on {tuning['split']} "
                        f"({tuning['sentences']} sentences; sacreBLEU by alpha {tried})")
    if results.get("recipe", {}).get("lowercase"):
        lines.insert(1, "  lowercased data (recipe.lowercase): every score is against the "
                        "lowercased references")
    return "\n".join(lines)
