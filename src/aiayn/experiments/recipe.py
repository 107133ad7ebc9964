"""A recipe: one experiment file run end to end, data to BLEU, with a manifest of the run.

data -> prepare -> train -> average -> translate the test set -> evaluate (section 5, 6.1),
each stage writing files into one run directory:

    RUN/data/raw/        the downloaded (or copied) corpus, verified by sha256
    RUN/data/prepared/   subword model, id tensors, manifest
    RUN/checkpoint_*.pt  training checkpoints (resumable: rerunning continues)
    RUN/checkpoint_avg.pt  the average of the last K checkpoints
    RUN/member1/ ...     with [recipe] ensemble = K > 1: K training runs (each with its
                         checkpoints and checkpoint_avg.pt) instead of the two lines above
    RUN/tune_alpha/      the validation set translated at each length penalty tried
    RUN/test.hyp         the translated test set
    RUN/results.json     scores with signatures, and the run's manifest

The experiment file is a preset plus overrides (see `config.load_experiment`) and a
[recipe] table for what is not a model, training or decoding setting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import platform
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from multiprocessing.connection import wait as wait_for
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
from aiayn.training.trainer import Hooks

if TYPE_CHECKING:
    from aiayn.decoding.translate import Decoder, SubwordTokenizer
    from aiayn.training.trainer import TrainResult

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
    # Beyond the paper (its rows are single models): train this many models at once, seeds
    # train.seed, train.seed + 1, ..., each in its own process on an equal share of the
    # CPU threads, each averaged, and translate with their ensemble (`aiayn.decoding.ensemble`: the
    # mean of their next-token probabilities). The run directory then holds member1/ ...
    # memberK/, each a training run of its own. 1: one model, the paper's recipe.
    ensemble: int = 1


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
            isinstance(a, int | float) and not isinstance(a, bool) and a >= 0 for a in grid
        ):
            raise ConfigError(
                f"{where}: recipe.tune_alpha must be a list of numbers >= 0, got {grid!r}"
            )
        table = {**table, "tune_alpha": tuple(float(a) for a in grid)}
    recipe = RecipeConfig(**table)
    if recipe.dataset != "multi30k":
        raise ConfigError(f"{where}: recipe.dataset must be 'multi30k', got {recipe.dataset!r}")
    if (
        recipe.average_last < 1
        or recipe.vocab_size < 10
        or recipe.max_train_pairs < 0
        or recipe.max_test_pairs < 0
        or recipe.ensemble < 1
    ):
        raise ConfigError(
            f"{where}: recipe.average_last >= 1, vocab_size >= 10, "
            "max_train_pairs >= 0, max_test_pairs >= 0 and ensemble >= 1 "
            "are required"
        )
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


def load_recipe(
    path: str | Path, overrides: dict[str, Any] | None = None
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
        raise ConfigError(
            f"{path}: train.keep_last ({cfg.train.keep_last}) must be at least "
            f"recipe.average_last ({recipe.average_last})"
        )
    return cfg, recipe


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


def _lowercase_copy(src_prefix: Path, langs: list[str], out_prefix: Path) -> None:
    """Write each PREFIX.LANG[.gz] lowercased to OUT_PREFIX.LANG ([recipe] lowercase)."""
    from aiayn.data.prepare import find_input
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
    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        **cpu_kernels(),
    }
    if torch.cuda.is_available():
        machine["cuda_devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    return {"versions": versions, "machine": machine}


def cpu_kernels() -> dict[str, Any]:
    """Which vector units PyTorch and oneDNN use on this CPU.

    They choose oneDNN's kernels, and so how a bf16 run's sums round: the same seed
    reproduced bit for bit on Sapphire Rapids VMs (AMX) and gave another run, 0.31-0.34
    BLEU apart, on an AVX-512 BF16 CPU without AMX (AMD EPYC; docs/results.md).
    """
    flags = set(_cpuinfo("flags").split())
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }


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


# --------------------------------------------------------------------------- ensemble members
def train_summary(result: TrainResult) -> dict[str, Any]:
    """What the manifest keeps of one training run."""
    from aiayn.experiments.curves import read_log

    state = result.state
    return {
        "steps": state.step,
        "epochs": state.epoch,
        "tokens": state.tokens_seen,
        "train_seconds": state.train_seconds,
        "stopped_by": result.stopped_by,
        "best_valid_nll": state.best_valid_nll,
        "flops": state.flops,
        "last_valid": next(
            (h for h in reversed(read_log(result.run_dir)) if "valid_nll" in h), None
        ),
    }


#: What a member process leaves in its run directory for the recipe.
MEMBER_RESULT = "member_result.json"


def _train_member(
    cfg: Config, data_dir: Path, run_dir: Path, device: str, threads: int, log_level: int
) -> None:
    """One ensemble member, in a process of its own (the entry point of `train_members`)."""
    from aiayn.training.trainer import train

    os.setpgrp()  # a terminal's Ctrl-C reaches the recipe only, which passes it on once
    torch.set_num_threads(threads)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s {run_dir.name} %(name)s: %(message)s"
    )
    result = train(cfg, data_dir, run_dir, device=device)
    summary = {**train_summary(result), "seed": cfg.train.seed}
    write_text_atomic(run_dir / MEMBER_RESULT, json.dumps(summary) + "\n")


class _LogFollower:
    """Feeds the new records of a run's train_log.jsonl to the CLI's progress hooks."""

    def __init__(self, run_dir: Path, hooks: Hooks | None) -> None:
        self.path, self.hooks, self.offset = run_dir / "train_log.jsonl", hooks, 0

    def poll(self) -> None:
        if self.hooks is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        done = data.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
        self.offset += done
        for line in data[:done].decode("utf-8").splitlines():
            record = json.loads(line) if line.strip() else {}
            if "loss" in record and self.hooks.on_step is not None:
                self.hooks.on_step(record["step"], record)
            elif "valid_nll" in record and self.hooks.on_valid is not None:
                self.hooks.on_valid(record["step"], record)


def member_dirs(out: Path, k: int) -> list[Path]:
    """The run directories of an ensemble recipe's k members."""
    return [out / f"member{i + 1}" for i in range(k)]


def train_members(
    cfg: Config,
    data_dir: Path,
    out: Path,
    k: int,
    *,
    device: str = "cpu",
    hooks: Hooks | None = None,
) -> list[dict[str, Any]]:
    """Train k models of `cfg` at once into `member_dirs(out, k)`, with seeds
    train.seed, train.seed + 1, ..., each in a spawned process with 1/k of this process's
    threads (on a 2-core CPU two one-thread runs did 1.37x the steps of one two-thread run
    in the same time: docs/results.md). Each member is an ordinary run directory, so a
    rerun resumes every member. SIGTERM and SIGINT (Ctrl-C) are passed on to the members,
    which finish their step, save and stop, as `aiayn train` does (a second Ctrl-C stops
    them at once); the recipe then goes on with what they saved, as after a single run.
    The progress hooks follow member 1.

    Returns:
        Each member's `train_summary`, with its "seed".
    Raises:
        TrainingError naming the members whose process failed (their errors are logged).
    """
    from aiayn.training.trainer import TrainingError

    threads = max(1, torch.get_num_threads() // k)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked thread pools
    dirs = member_dirs(out, k)
    procs = []
    for i, run_dir in enumerate(dirs):
        (run_dir / MEMBER_RESULT).unlink(missing_ok=True)
        member_cfg = apply_overrides(cfg, {"train.seed": cfg.train.seed + i})
        proc = ctx.Process(
            target=_train_member,
            name=f"aiayn-{run_dir.name}",
            daemon=True,
            args=(
                member_cfg,
                data_dir,
                run_dir,
                device,
                threads,
                logging.getLogger().getEffectiveLevel(),
            ),
        )
        proc.start()
        procs.append(proc)
        log.info("%s: seed %d, %d thread(s)", run_dir.name, member_cfg.train.seed, threads)

    def forward(signum: int, frame: Any) -> None:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError):  # not the main thread: no handler
            old[sig] = signal.signal(sig, forward)
    follow = _LogFollower(dirs[0], hooks)
    try:
        while alive := [proc.sentinel for proc in procs if proc.is_alive()]:
            wait_for(alive, timeout=2)  # back at once when a member ends
            follow.poll()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    follow.poll()
    failed = [
        f"{d} (exit code {p.exitcode})"
        for d, p in zip(dirs, procs, strict=True)
        if p.exitcode != 0 or not (d / MEMBER_RESULT).exists()
    ]
    if failed:
        raise TrainingError(
            f"ensemble member training failed: {', '.join(failed)}; its "
            "error is logged above; rerunning the recipe resumes each member"
        )
    return [json.loads((d / MEMBER_RESULT).read_text(encoding="utf-8")) for d in dirs]


def run_recipe(
    path: str | Path,
    out: str | Path,
    *,
    data: str | Path | None = None,
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
    hooks: Hooks | None = None,
) -> dict[str, Any]:
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
    from aiayn.checkpoints import (
        average_checkpoints,
        list_last,
        load_ensemble,
        save_checkpoint_file,
    )
    from aiayn.data.download import download_multi30k
    from aiayn.data.prepare import find_input, prepare
    from aiayn.decoding.ensemble import as_decoder
    from aiayn.decoding.translate import translate_file
    from aiayn.experiments.curves import plot_curves
    from aiayn.fast.flops import cpu_matmul_rates, matmul_peak, slow_bf16_warning
    from aiayn.scoring.bleu import score_files
    from aiayn.training.trainer import train

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
    for split, n in (
        (recipe.train_split, recipe.max_train_pairs),
        (recipe.valid_split, recipe.max_test_pairs if recipe.tune_alpha else 0),
        (recipe.test_split, recipe.max_test_pairs),
    ):
        if n:
            prefixes[split] = out / "data" / f"{split}.first{n}"
            _truncate_copy(full[split], [src, tgt], prefixes[split], n)
    prepared = out / "data" / "prepared"
    manifest = prepare(
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
    )
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
    if recipe.ensemble == 1:
        runs = [out]
        trained = [train_summary(train(cfg, prepared, out, device=device, hooks=hooks))]
    else:
        runs = member_dirs(out, recipe.ensemble)
        trained = train_members(cfg, prepared, out, recipe.ensemble, device=device, hooks=hooks)
    wall["train_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    averaged = []
    for run in runs:
        paths = list_last(run, recipe.average_last, strict=False)
        save_checkpoint_file(run / "checkpoint_avg.pt", average_checkpoints(paths))
        averaged.append([p.name for p in paths])
    models, tokenizer, avg_cfg = load_ensemble(
        [run / "checkpoint_avg.pt" for run in runs], device=device
    )
    model = as_decoder(models)
    wall["average_s"] = time.perf_counter() - t0

    decode, tuning = cfg.decode, None
    if recipe.tune_alpha:
        t0 = time.perf_counter()
        valid = [find_input(prefixes[recipe.valid_split], lang) for lang in (src, tgt)]
        decode, tuning = tune_alpha(
            model,
            tokenizer,
            valid[0],
            valid[1],
            tgt,
            cfg.decode,
            recipe.tune_alpha,
            out / "tune_alpha",
            device=device,
        )
        tuning["split"] = recipe.valid_split
        wall["tune_alpha_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    test_src, test_ref = (find_input(prefixes[recipe.test_split], lang) for lang in (src, tgt))
    hyp = out / f"{recipe.test_split}.{src}-{tgt}.hyp"
    summary = translate_file(model, tokenizer, test_src, hyp, decode, device=device)
    wall["translate_s"] = time.perf_counter() - t0
    scores = score_files(hyp, test_ref, tgt)

    train_record = {k: v for k, v in trained[0].items() if k not in ("flops", "seed")}
    flops = sum(t["flops"] for t in trained)
    if len(runs) > 1:
        # the members' own test scores, at the same settings: what the ensemble adds
        t0 = time.perf_counter()
        members = []
        for run, member, t, names in zip(runs, models, trained, averaged, strict=True):
            member_hyp = run / hyp.name
            translate_file(member, tokenizer, test_src, member_hyp, decode, device=device)
            members.append(
                {
                    "run": run.name,
                    **t,
                    "averaged": names,
                    "scores": score_files(member_hyp, test_ref, tgt).to_dict(),
                }
            )
        wall["translate_members_s"] = time.perf_counter() - t0
        # trained side by side: the stage's time is the longest member's, the tokens add up
        train_record.update(
            train_seconds=max(t["train_seconds"] for t in trained),
            tokens=sum(t["tokens"] for t in trained),
            members=members,
        )
    train_seconds = train_record["train_seconds"]
    results = {
        "experiment": str(path),
        "test_split": recipe.test_split,
        "pair": f"{src}-{tgt}",
        "scores": scores.to_dict(),
        "averaged": averaged[0],
        "train": train_record,
        "flops": {
            "counted_from_model": flops,
            "estimated_time_x_devices_x_peak": train_seconds * peak,
            "sustained_peak_flop_s": peak,
            "peak_dtype": str(peak_dtype),
            "model_flop_s": flops / max(train_seconds, 1e-9),
        },
        "wall_seconds": wall,
        "translate": summary,
        "alpha_tuning": tuning,
        "parameters": sum(p.numel() for p in models[0].parameters()),
        "ensemble": len(models),
        "seed": cfg.train.seed,
        "recipe": asdict(recipe),
        # the decode settings the test set was translated with (alpha as tuned)
        "config": replace(avg_cfg, decode=decode).to_dict(),
        "data": {
            "prepared_manifest_sha256": sha256_file(prepared / "manifest.json"),
            "vocab_sha256": manifest["spm_model"]["sha256"],
            "inputs": manifest["inputs"],
            "test": {"src": sha256_file(test_src), "tgt": sha256_file(test_ref)},
        },
        **environment(),
    }
    write_text_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    try:
        labels: dict[str, str | Path] = (
            {f"{src}-{tgt}": out}
            if len(runs) == 1
            else {
                f"{src}-{tgt} {run.name} (seed {t['seed']})": run
                for run, t in zip(runs, trained, strict=True)
            }
        )
        plot_curves(labels, out / "curve.png", title=str(path))
    except ImportError:
        log.info("matplotlib is not installed (pip install 'aiayn[plot]'): no curve.png")
    return results


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
) -> tuple[DecodeConfig, dict[str, Any]]:
    """Translate the validation set at each length penalty in `grid` and keep the best.

    The criterion is sacreBLEU; a tie goes to the value listed first. The hypotheses stay
    in `out` (one file per alpha) for inspection.

    Returns:
        The decode settings with the chosen alpha, and a record of every alpha's scores.
    """
    from aiayn.decoding.translate import translate_file
    from aiayn.scoring.bleu import score_files

    if not grid:
        raise ValueError("tune_alpha needs at least one alpha to try")
    out.mkdir(parents=True, exist_ok=True)
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
    if tuning:
        tried = ", ".join(f"{r['alpha']:g}: {r['sacrebleu']:.2f}" for r in tuning["tried"])
        lines.insert(
            1,
            f"  beam {results['config']['decode']['beam']}, alpha "
            f"{tuning['chosen']:g} chosen on {tuning['split']} "
            f"({tuning['sentences']} sentences; sacreBLEU by alpha {tried})",
        )
    if results.get("recipe", {}).get("lowercase"):
        lines.insert(
            1,
            "  lowercased data (recipe.lowercase): every score is against the "
            "lowercased references",
        )
    return "\n".join(lines)
