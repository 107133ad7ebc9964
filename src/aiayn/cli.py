"""The `aiayn` command: each subcommand parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiayn.config import Config, ConfigError, apply_overrides, get_preset, load_experiment

log = logging.getLogger("aiayn")

# glibc returns large freed blocks to the kernel and faults them back in on every step; on
# VMs with slow page faults that costs 30-65% of a training step. These keep them.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "17179869184", "MALLOC_TRIM_THRESHOLD_": "17179869184",
              "MALLOC_TOP_PAD_": "536870912"}
HEAVY_COMMANDS = {"train", "translate", "recipe", "bench"}


def _maybe_reexec_with_malloc_settings(argv: list[str]) -> None:
    """Re-run this process with the allocator settings (opt out: AIAYN_NO_MALLOC_TUNING=1)."""
    if os.environ.get("AIAYN_NO_MALLOC_TUNING") or not argv or argv[0] not in HEAVY_COMMANDS:
        return
    if all(os.environ.get(k) for k in MALLOC_ENV) or sys.platform != "linux":
        return
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()}}
    os.execve(sys.executable, [sys.executable, "-m", "aiayn", *argv], env)


# --------------------------------------------------------------------------- helpers
def _resolve_config(args: argparse.Namespace) -> Config:
    """Preset or experiment file, then explicit flags, then --set (which come last)."""
    if getattr(args, "config", None):
        cfg, _ = load_experiment(args.config)
    else:
        cfg = get_preset(args.preset or "base")
    overrides: dict[str, Any] = {}
    for flag, key in (("max_steps", "train.max_steps"), ("max_minutes", "train.max_minutes"),
                      ("save_interval_steps", "train.save_interval_steps"),
                      ("save_interval_minutes", "train.save_interval_minutes"),
                      ("keep_last", "train.keep_last"), ("seed", "train.seed"),
                      ("max_tokens", "train.max_tokens"), ("update_freq", "train.update_freq"),
                      ("dtype", "train.dtype"), ("valid_interval_steps",
                                                 "train.valid_interval_steps")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    from aiayn.config import parse_set_args

    overrides.update(parse_set_args(getattr(args, "set", None) or []))
    return apply_overrides(cfg, overrides)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    # default None, not "base": argparse does not see a conflict when the value given
    # is the default object itself (`--preset base --config x.toml` would pass silently)
    g.add_argument("--preset", help="base (default), big, tiny or a Table 3 row (A1..E)")
    g.add_argument("--config", help="experiment file (TOML): a preset plus overrides")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any config key (e.g. --set P_drop=0.3); applied last")


def _progress(total: int, disable: bool) -> tuple[Any, Any]:
    """A training progress bar (loss, lr, tokens/s) and the Hooks that drive it."""
    from tqdm import tqdm

    from aiayn.train import Hooks

    # Under torchrun only rank 0 draws a bar.
    quiet = disable or os.environ.get("RANK", "0") != "0"
    bar = tqdm(total=total, disable=quiet or None, unit="step", dynamic_ncols=True)

    def on_step(step: int, s: dict[str, float]) -> None:
        bar.n = step
        bar.set_postfix(loss=f"{s['loss']:.3f}", lr=f"{s['lr']:.2e}",
                        tok_s=f"{s['tokens_per_s']:.0f}", refresh=False)
        bar.update(0)

    def on_valid(step: int, m: dict[str, float]) -> None:
        bar.write(f"step {step}: valid nll {m['valid_nll']:.4f} ppl {m['valid_ppl']:.2f}")

    return bar, Hooks(on_step, on_valid)


# --------------------------------------------------------------------------- commands
def cmd_data(args: argparse.Namespace) -> int:
    from aiayn.download import download_multi30k

    kwargs: dict[str, Any] = {}
    if args.splits:
        kwargs["splits"] = args.splits.split(",")
    if args.langs:
        kwargs["langs"] = args.langs.split(",")
    paths = download_multi30k(Path(args.out), Path(args.from_dir) if args.from_dir else None,
                              **kwargs)
    print(f"{len(paths)} files in {args.out}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from aiayn.data import prepare

    manifest = prepare(args.source_lang, args.target_lang, Path(args.trainpref),
                       Path(args.validpref) if args.validpref else None,
                       Path(args.testpref) if args.testpref else None, Path(args.out),
                       vocab_size=args.vocab_size, max_len=args.max_len,
                       max_len_ratio=args.max_len_ratio, on_empty=args.on_empty,
                       on_bad_utf8=args.on_bad_utf8, lowercase=args.lowercase)
    for split, info in manifest.get("splits", {}).items():
        print(f"{split}: {info}")
    print(f"prepared {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from aiayn.train import train

    cfg = _resolve_config(args)
    if args.dump_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    bar, hooks = _progress(cfg.train.max_steps, args.no_progress)
    try:
        result = train(cfg, args.data, args.out, device=args.device,
                       reset_optimizer=args.reset_optimizer,
                       reset_dataloader=args.reset_dataloader, hooks=hooks)
    finally:
        bar.close()
    if result.stopped_by == "already_done":
        print(f"already at step {result.state.step} >= max_steps {cfg.train.max_steps}")
        return 0
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the job
        print(f"stopped ({result.stopped_by}) at step {result.state.step}; last checkpoint: "
              f"{result.last_checkpoint}")
    return {"SIGTERM": 143, "SIGINT": 130}.get(result.stopped_by, 0)


def cmd_average(args: argparse.Namespace) -> int:
    from aiayn.checkpoint import average_checkpoints, list_last, save_checkpoint_file

    inputs = [Path(p) for p in args.inputs]
    one_run = len(inputs) == 1 and inputs[0].is_dir()
    paths = list_last(inputs[0], args.last, strict=False) if one_run else inputs
    avg = average_checkpoints(paths, force=args.force)
    save_checkpoint_file(Path(args.out), avg)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {args.out}")
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from aiayn.checkpoint import load_ensemble
    from aiayn.ensemble import as_decoder
    from aiayn.translate import cast_for_inference, translate_file

    models, tokenizer, cfg = load_ensemble([Path(p) for p in args.checkpoint],
                                           device=args.device)
    model = as_decoder([cast_for_inference(m, args.dtype) for m in models])
    overrides: dict[str, Any] = {}
    for flag in ("beam", "alpha", "max_len_a", "max_len_b", "nbest", "max_tokens"):
        if getattr(args, flag) is not None:
            overrides[f"decode.{flag}"] = getattr(args, flag)
    if args.greedy:
        overrides["decode.beam"] = 1
    cfg = apply_overrides(cfg, overrides)
    from tqdm import tqdm

    # lines done, on stderr, only when it is a terminal (the JSON summary follows it)
    bar = tqdm(unit=" lines", disable=args.no_progress or None, dynamic_ncols=True,
               file=sys.stderr)
    try:
        summary = translate_file(model, tokenizer, args.input, args.output, cfg.decode,
                                 device=args.device, progress=bar.update,
                                 workers=args.workers)
    finally:
        bar.close()
    print(json.dumps(summary), file=sys.stderr)
    return 3 if summary.get("bad_utf8") else 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from aiayn.evaluate import score_files

    scores = score_files(Path(args.hyp), Path(args.ref), args.lang, bootstrap=args.bootstrap)
    print(json.dumps(scores.to_dict(), indent=2) if args.json else scores.format())
    return 0


def cmd_recipe(args: argparse.Namespace) -> int:
    from aiayn.config import parse_set_args
    from aiayn.recipe import format_results, load_recipe, run_recipe

    overrides: dict[str, Any] = parse_set_args(args.set or [])
    if args.max_minutes is not None:
        overrides["train.max_minutes"] = args.max_minutes
    if args.seed is not None:
        overrides["train.seed"] = args.seed
    cfg, _ = load_recipe(args.config, overrides)
    bar, hooks = _progress(cfg.train.max_steps, args.no_progress)
    try:
        results = run_recipe(args.config, args.out, data=args.data, device=args.device,
                             overrides=overrides, hooks=hooks)
    finally:
        bar.close()
    print(format_results(results))
    print(f"results: {Path(args.out) / 'results.json'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from aiayn import bench

    dtypes = args.dtype.split(",")
    for dtype in dtypes:
        if args.what == "peak":
            result = bench.bench_peak(dtype, args.device)
        elif args.what == "train":
            result = bench.bench_train(args.preset, dtype, args.device, steps=args.steps,
                                       batch=args.batch_sentences or 291,
                                       compile=args.compile)
        else:
            result = bench.bench_decode(args.preset, dtype, args.device, beam=args.beam,
                                        alpha=args.alpha, out_len=args.out_len,
                                        sentences=args.sentences,
                                        batch=args.batch_sentences or 64, peak=True,
                                        workers=args.workers)
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in result.items()), flush=True)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch

    from aiayn.model import Transformer, count_parameters, parameter_formula

    cfg = _resolve_config(args)
    model_cfg = replace(cfg.model, vocab_size=args.vocab_size)
    with torch.device("meta"):
        n = count_parameters(Transformer(model_cfg))
    info = {"preset": args.config or args.preset or "base", "vocab_size": args.vocab_size,
            "parameters": n, "parameters_formula": parameter_formula(model_cfg),
            "config": replace(cfg, model=model_cfg).to_dict()}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        m = model_cfg
        print(f"{info['preset']}: N={m.N} d_model={m.d_model} d_ff={m.d_ff} h={m.h} d_k={m.d_k} "
              f"d_v={m.d_v} P_drop={m.P_drop} eps_ls={cfg.train.eps_ls} "
              f"positional={m.positional}")
        print(f"parameters: {n:,} ({n / 1e6:.1f}M) with a shared vocabulary of "
              f"{args.vocab_size:,}")
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("data", help="download a data set (verified by sha256)")
    p.add_argument("dataset", choices=["multi30k"])
    p.add_argument("--out", required=True)
    p.add_argument("--from", dest="from_dir", help="copy from a local directory instead")
    p.add_argument("--splits", help="comma-separated, e.g. train,val,test_2016_flickr")
    p.add_argument("--langs", help="comma-separated, e.g. en,de")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("prepare", help="train the shared subword vocabulary and encode data")
    p.add_argument("--source-lang", "-s", required=True)
    p.add_argument("--target-lang", "-t", required=True)
    p.add_argument("--trainpref", required=True, help="PREFIX for PREFIX.LANG[.gz]")
    p.add_argument("--validpref")
    p.add_argument("--testpref")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-len", type=int, default=256, help="filter longer training pairs")
    p.add_argument("--max-len-ratio", type=float, default=9.0)
    p.add_argument("--on-empty", choices=["skip", "error"], default="skip")
    p.add_argument("--on-bad-utf8", choices=["error", "skip"], default="error")
    p.add_argument("--lowercase", action="store_true",
                   help="a vocabulary that lowercases its input (and so the model's)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="train or resume a model")
    p.add_argument("data", help="directory made by `aiayn prepare`")
    p.add_argument("--out", required=True, help="run directory (resumes if it has checkpoints)")
    _add_config_args(p)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--max-minutes", type=float, help="training wall-clock budget")
    p.add_argument("--save-interval-steps", type=int)
    p.add_argument("--save-interval-minutes", type=float)
    p.add_argument("--valid-interval-steps", type=int)
    p.add_argument("--keep-last", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-tokens", type=int, help="tokens per batch and side")
    p.add_argument("--update-freq", type=int, help="gradient accumulation")
    p.add_argument("--dtype", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--reset-optimizer", action="store_true",
                   help="resume weights but start a fresh optimizer and schedule settings")
    p.add_argument("--reset-dataloader", action="store_true",
                   help="resume on changed data or batching: start a new epoch")
    p.add_argument("--dump-config", action="store_true", help="print the effective config")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("average", help="average checkpoints (section 6.1)")
    p.add_argument("inputs", nargs="+", help="a run directory, or checkpoint files")
    p.add_argument("--last", type=int, default=5, help="with a run directory: how many")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="allow mixing different runs")
    p.set_defaults(func=cmd_average)

    p = sub.add_parser("translate", help="beam search translation of a file or stdin")
    p.add_argument("--checkpoint", required=True, nargs="+", action="extend",
                   help="a model; several (same vocabulary) decode as an ensemble: the "
                        "mean of their next-token probabilities, the first one's decoding "
                        "options")
    p.add_argument("--input", help="default: stdin")
    p.add_argument("--output", help="default: stdout")
    p.add_argument("--beam", type=int)
    p.add_argument("--alpha", type=float, help="length penalty ((5+|Y|)/6)^alpha")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--max-len-a", type=float)
    p.add_argument("--max-len-b", type=int)
    p.add_argument("--nbest", type=int)
    p.add_argument("--max-tokens", type=int, help="source tokens per batch")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                   help="inference precision (bf16: weights and activations, on x86 CPUs "
                        "with weights packed for oneDNN once; int8: dynamic quantization, CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=1,
                   help="CPU: decode whole batches in this many forked processes of one "
                        "thread each (e.g. one per core: faster than one process with all "
                        "threads on small CPUs; see docs/performance.md)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (drawn only when stderr is a terminal)")
    p.set_defaults(func=cmd_translate)

    p = sub.add_parser("evaluate", help="BLEU (sacreBLEU and tokenized), chrF")
    p.add_argument("--hyp", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--lang", help="target language (default: the reference's suffix)")
    p.add_argument("--bootstrap", type=int, default=0, metavar="N",
                   help="95%% confidence interval of BLEU from N resamples (fixed seed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("recipe", help="run an experiment file end to end: data to BLEU")
    p.add_argument("config", help="experiment file, e.g. configs/multi30k-en-de.toml")
    p.add_argument("--out", required=True, help="run directory (rerun to resume)")
    p.add_argument("--data", help="local copy of the corpus (default: download it)")
    p.add_argument("--max-minutes", type=float, help="training wall-clock budget")
    p.add_argument("--seed", type=int)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_recipe)

    p = sub.add_parser("bench", help="throughput: training step, decoding, matmul peak")
    p.add_argument("what", choices=["train", "decode", "peak"])
    p.add_argument("--preset", default="base")
    p.add_argument("--dtype", default="bf16",
                   help="fp32, bf16 (decode and peak also int8); a comma-separated list runs each")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps (median)")
    p.add_argument("--beam", type=int, default=4, help="decode: beam size (1 = greedy)")
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--out-len", type=int, default=20, help="decode: tokens per output")
    p.add_argument("--sentences", type=int, default=500, help="decode: sentences")
    p.add_argument("--batch-sentences", type=int, help="default 291 (train), 64 (decode)")
    p.add_argument("--compile", action="store_true",
                   help="train: the model's forward through torch.compile (compiling falls "
                        "in the warm-up, reported as warmup_seconds)")
    p.add_argument("--workers", type=int, default=1,
                   help="decode: batches in this many processes of one thread each (CPU)")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("info", help="configuration and parameter count")
    _add_config_args(p)
    p.add_argument("--vocab-size", type=int, default=37000)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)
    return parser


def _known_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConfigError]
    for module, name in (("aiayn.files", "InputError"), ("aiayn.checkpoint", "CheckpointError"),
                         ("aiayn.train", "TrainingError")):
        with contextlib.suppress(ImportError, AttributeError):
            errors.append(getattr(__import__(module, fromlist=[name]), name))
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        _maybe_reexec_with_malloc_settings(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # a reader that went away shows here, inside the handler below
        return code
    except BrokenPipeError:
        # the reader went away (`aiayn evaluate ... | head`): stop quietly, as `cat` does;
        # stdout goes to /dev/null so that the interpreter's final flush cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the shell's code for a process its pipe's reader left
    except ConfigError as e:
        print(f"aiayn: error: {e}", file=sys.stderr)
        return 2
    except (*_known_errors(), ValueError) as e:  # type: ignore[misc]  # a tuple of types
        # Library functions raise ValueError for bad input (line counts that differ in
        # `evaluate`, an unknown split in `data`): one line, the traceback only with -v.
        log.debug("traceback", exc_info=True)
        print(f"aiayn {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
