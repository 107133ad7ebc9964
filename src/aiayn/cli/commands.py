"""The subcommands: each takes the parsed arguments and calls one library function.

Every import of another aiayn module (but `aiayn.config`) is inside the function that needs
it, so that `aiayn --help` is quick and works whatever the rest of the package imports.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from aiayn.cli.resume import resolve_config, resolve_train_config
from aiayn.config import Config, apply_overrides, parse_set_args
from aiayn.files import UsageError, check_output_dir, check_output_file

log = logging.getLogger("aiayn")


def check_device(name: str) -> str:
    """`name` if this PyTorch can run on it, else a UsageError saying why: before any
    work, not as a traceback from deep inside torch."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            raise UsageError(
                f"--device {name}: this PyTorch ({torch.__version__}) has {build}; use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {name}: there are {torch.cuda.device_count()} GPUs (cuda:0..)"
            )
    elif device.type != "cpu":
        raise UsageError(f"--device {name}: aiayn runs on cpu or cuda, not {device.type}")
    return name


def _is_average(path: Path) -> bool:
    """Whether an existing file is a checkpoint `aiayn average` wrote."""
    from aiayn.checkpoints import CheckpointError, load_checkpoint

    try:
        return "averaged_from" in load_checkpoint(path, mmap=True)
    except CheckpointError:
        return False


def _progress(total: int, disable: bool) -> tuple[Any, Any]:
    """A training progress bar (loss, lr, tokens/s) and the Hooks that drive it."""
    from tqdm import tqdm

    from aiayn.training.trainer import Hooks

    # Under torchrun only rank 0 draws a bar.
    quiet = disable or os.environ.get("RANK", "0") != "0"
    bar = tqdm(total=total, disable=quiet or None, unit="step", dynamic_ncols=True)

    def on_step(step: int, s: dict[str, float]) -> None:
        bar.n = step
        bar.set_postfix(
            loss=f"{s['loss']:.3f}",
            lr=f"{s['lr']:.2e}",
            tok_s=f"{s['tokens_per_s']:.0f}",
            refresh=False,
        )
        bar.update(0)

    def on_valid(step: int, m: dict[str, float]) -> None:
        bleu = f" BLEU {m['valid_bleu']:.2f}" if "valid_bleu" in m else ""
        bar.write(f"step {step}: valid nll {m['valid_nll']:.4f} ppl {m['valid_ppl']:.2f}{bleu}")

    return bar, Hooks(on_step, on_valid)


def cmd_data(args: argparse.Namespace) -> int:
    """`aiayn data`: copy or download a corpus, verified, by the task that reads it."""
    from aiayn.experiments.tasks import task_reading

    check_output_dir(args.out)
    names = ("splits", "langs", "pair", "split", "train", "dev", "test")
    options = {name: getattr(args, name) for name in names}
    source = Path(args.from_dir) if args.from_dir is not None else None
    for line in task_reading(args.dataset).fetch(args.dataset, Path(args.out), source, options):
        print(line)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """`aiayn prepare`: learn the shared vocabulary and encode the splits."""
    from aiayn.data.corpus import MANIFEST_FILE
    from aiayn.data.prepare import prepare

    out = check_output_dir(args.out)
    if (out / MANIFEST_FILE).exists() and not args.force:
        raise UsageError(
            f"--out {out} already holds a prepared set ({out / MANIFEST_FILE}); models "
            "trained on it need its vocabulary: choose another directory, or pass --force "
            "to replace it"
        )
    streaming_only = ("workers", "spm_sample", "spm_threads")
    given = [f"--{k.replace('_', '-')}" for k in streaming_only if getattr(args, k) is not None]
    if given and not args.streaming:
        raise UsageError(f"{', '.join(given)} need --streaming")
    if args.vocab == "separate" and args.streaming:
        raise UsageError("--vocab separate is not implemented with --streaming yet")
    kwargs: dict[str, Any] = {}
    if args.streaming:
        from aiayn.data.stream_prepare import prepare_streaming as prepare  # type: ignore[assignment]

        kwargs = {k: getattr(args, k) for k in streaming_only if getattr(args, k) is not None}
    manifest = prepare(
        args.source_lang,
        args.target_lang,
        Path(args.trainpref),
        Path(args.validpref) if args.validpref else None,
        Path(args.testpref) if args.testpref else None,
        Path(args.out),
        vocab_size=args.vocab_size,
        max_len=args.max_len,
        max_len_ratio=args.max_len_ratio,
        on_empty=args.on_empty,
        on_bad_utf8=args.on_bad_utf8,
        lowercase=args.lowercase,
        split_by_script=args.split_by_script,
        model_type=args.model_type,
        seed=args.seed,
        **kwargs,
        **({"vocab": args.vocab} if args.vocab != "shared" else {}),
    )
    for split, info in manifest.get("splits", {}).items():
        print(f"{split}: {info}")
    print(f"prepared {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """`aiayn train`: train, or resume, one run directory."""
    from aiayn.training.trainer import train

    cfg = resolve_config(args) if args.dump_config else resolve_train_config(args)
    if args.dump_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    check_device(args.device)
    from aiayn.cli.extras import warn_tensorboard

    warn_tensorboard(cfg.train.tensorboard)
    bar, hooks = _progress(cfg.train.max_steps, args.no_progress)
    try:
        result = train(
            cfg,
            args.data,
            args.out,
            device=args.device,
            reset_optimizer=args.reset_optimizer,
            reset_dataloader=args.reset_dataloader,
            hooks=hooks,
        )
    finally:
        bar.close()
    if result.stopped_by == "already_done":
        print(f"already at step {result.state.step} >= max_steps {cfg.train.max_steps}")
        return 0
    if result.last_checkpoint is None and result.stopped_by in ("max_minutes", "patience"):
        print(f"already stopped ({result.stopped_by}) at step {result.state.step}: nothing to do")
        return 0
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the job
        print(
            f"stopped ({result.stopped_by}) at step {result.state.step}; last checkpoint: "
            f"{result.last_checkpoint}"
        )
    return {"SIGTERM": 143, "SIGINT": 130}.get(result.stopped_by, 0)


def cmd_average(args: argparse.Namespace) -> int:
    """`aiayn average`: average checkpoints into one."""
    from aiayn.checkpoints import average_checkpoints, list_last, save_checkpoint_file

    inputs = [Path(p) for p in args.inputs]
    one_run = len(inputs) == 1 and inputs[0].is_dir()
    paths = list_last(inputs[0], args.last, strict=False) if one_run else inputs
    out = Path(args.out)
    # an earlier average may be replaced; a training checkpoint only with --force
    previous_average = out.is_file() and _is_average(out)
    check_output_file(
        out,
        inputs=tuple(paths),
        force=args.force or previous_average,
        overwrite_ok=False,
        what="--out",
        stdout_ok=False,
    )
    avg = average_checkpoints(paths, force=args.force)
    save_checkpoint_file(Path(args.out), avg)
    names = avg["averaged_from"]  # each model once: a file named twice, or a copy, is dropped
    print(f"averaged {len(names)} checkpoints ({', '.join(names)}) -> {args.out}")
    return 0


def _load_decoder(
    args: argparse.Namespace, outputs: tuple[str, ...], extra: dict[str, Any]
) -> tuple[Any, Any, Config]:
    """translate's, parse's and serve's common start: check the device, the output flags named in
    `outputs` and --input before loading anything (--workers auto becomes a count); load the
    checkpoints as one decoder in --dtype; the config with the decoding flags given (and
    `extra`) applied."""
    from aiayn.checkpoints import load_ensemble
    from aiayn.decoding.ensemble import as_decoder
    from aiayn.fast.machine import cast_for_inference

    check_device(args.device)
    from aiayn.decoding.workers import resolve_workers

    given_workers = " (--workers auto)" if args.workers == "auto" else ""
    args.workers = resolve_workers(args.workers, args.device)
    source = getattr(args, "input", None)  # serve has none
    for flag in outputs:
        if getattr(args, flag) is not None:
            check_output_file(
                getattr(args, flag), inputs=(source, *args.checkpoint), force=args.force
            )
    if source is not None and not Path(source).exists():
        raise UsageError(f"--input {source}: no such file")
    from aiayn.fast.inference import int8_activation_bits

    try:  # a mistyped variable is named before the model loads
        int8_activation_bits()
    except ValueError as e:
        raise UsageError(str(e)) from None
    models, tokenizer, cfg = load_ensemble([Path(p) for p in args.checkpoint], device=args.device)
    if args.device.split(":")[0] == "cpu":  # what runs here, before the work
        from aiayn.fast import machine

        dtype = machine.resolve_decode_dtype(args.dtype)
        if dtype == "int8" and machine.int8_bits(args.dtype) == 7:
            env = os.environ.get("AIAYN_INT8_ACTIVATIONS")
            why = "AIAYN_INT8_ACTIVATIONS=7" if env else "auto: no VNNI"
            dtype += f" with 7-bit activations ({why})"
        log.info("%s", machine.describe())
        auto = " (--dtype auto)" if args.dtype == "auto" else ""
        n = args.workers
        where = f"up to {n} worker processes of one thread" if n > 1 else "this process"
        log.info("decoding in %s%s, in %s%s", dtype, auto, where, given_workers)
    model = as_decoder([cast_for_inference(m, args.dtype) for m in models])
    overrides = {
        f"decode.{flag}": getattr(args, flag)
        for flag in ("beam", "alpha", "max_len_a", "max_len_b", "nbest", "max_tokens")
        if getattr(args, flag, None) is not None
    }
    return model, tokenizer, apply_overrides(cfg, {**overrides, **extra})


def cmd_translate(args: argparse.Namespace) -> int:
    """`aiayn translate`: decode a file or stdin; exit 3 if the input had invalid UTF-8."""
    from tqdm import tqdm

    from aiayn.cli.commands_generate import sampling_options, translate_stdin
    from aiayn.decoding.translate import translate_file

    sampling = sampling_options(args)
    if args.input == "-":
        args.input = None
    if args.prefix is not None and (args.input is None or sampling is not None):
        raise UsageError(
            "--prefix needs --input FILE (its lines pair with the input's), not --sampling"
        )
    extra = {"decode.beam": 1} if args.greedy else {}
    model, tokenizer, cfg = _load_decoder(args, ("output",), extra)
    # lines done, on stderr, only when it is a terminal (the JSON summary follows it)
    bar = tqdm(unit=" lines", disable=args.no_progress or None, dynamic_ncols=True, file=sys.stderr)
    try:
        if args.input is None:  # stdin: each translation as soon as it is decoded
            summary = translate_stdin(model, tokenizer, args, cfg, sampling, bar)
        else:
            summary = translate_file(
                model,
                tokenizer,
                args.input,
                args.output,
                cfg.decode,
                device=args.device,
                progress=bar.update,
                workers=args.workers,
                sampling=sampling,
                prefix_path=args.prefix,
            )
    finally:
        bar.close()
    print(json.dumps(summary), file=sys.stderr)
    return 3 if summary.get("bad_utf8") else 0


def cmd_score(args: argparse.Namespace) -> int:
    """`aiayn score`: each pair's log-probability under the model (forced decoding)."""
    from aiayn.cli.commands_generate import score_files

    check_device(args.device)
    return score_files(args)


def cmd_evaluate(args: argparse.Namespace) -> int:
    """`aiayn evaluate`: a file of outputs scored by its task's scorer (translations: BLEU and
    chrF; trees: EVALB's bracketing scores)."""
    from aiayn.experiments.tasks import TASKS

    task = TASKS[args.task]
    given = {"lang": args.lang, "bootstrap": args.bootstrap, "params": args.params}
    given["report"] = args.report
    for option, value in given.items():
        if value and option not in task.score_options:
            owner = next(t.name for t in TASKS.values() if option in t.score_options)
            raise UsageError(f"--{option} is for --task {owner}")
    scored = task.score_files(
        Path(args.hyp), Path(args.ref), {k: given[k] for k in task.score_options}
    )
    if args.json:
        print(json.dumps(scored.values, indent=2))
    elif args.report and scored.report is not None:
        print(scored.report, end="")
    else:
        print(scored.text)
    return 0


def cmd_parse(args: argparse.Namespace) -> int:
    """`aiayn parse`: a tree a line for a file (or stdin); exit 3 if the input had invalid UTF-8."""
    from tqdm import tqdm

    from aiayn.decoding.parse import parse_file
    from aiayn.decoding.tree_constraint import TreeLimits, tree_limits
    from aiayn.files import read_lines

    limits = TreeLimits()
    if args.limits_from:
        limits = tree_limits(list(read_lines(Path(args.limits_from))))
    for flag in ("max_depth", "max_opens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    limits = TreeLimits(
        limits.max_depth if args.max_depth is None else args.max_depth,
        limits.max_opens if args.max_opens is None else args.max_opens,
    )
    model, tokenizer, cfg = _load_decoder(args, ("output", "raw_output"), {"decode.nbest": 1})
    bar = tqdm(unit=" lines", disable=args.no_progress or None, dynamic_ncols=True, file=sys.stderr)
    try:
        _, summary = parse_file(
            model,
            tokenizer,
            args.input,
            args.output,
            cfg.decode,
            device=args.device,
            progress=bar.update,
            workers=args.workers,
            raw_path=args.raw_output,
            constrained=args.constrained,
            limits=limits,
            linearization=args.tree_form,
            word_mass=args.word_mass,
        )
    finally:
        bar.close()
    print(json.dumps(summary), file=sys.stderr)
    return 3 if summary.get("bad_utf8") else 0


def cmd_recipe(args: argparse.Namespace) -> int:
    """`aiayn recipe`: an experiment file end to end, data to BLEU."""
    from aiayn.experiments.recipe import RecipeStoppedError, format_results, run_recipe
    from aiayn.experiments.tasks import load_experiment

    overrides: dict[str, Any] = parse_set_args(args.set or [])
    if args.max_minutes is not None:
        overrides["train.max_minutes"] = args.max_minutes
    if args.seed is not None:
        overrides["train.seed"] = args.seed
    experiment = load_experiment(args.config, overrides)  # read once, checked before any work
    cfg = experiment[0]
    check_device(args.device)
    if Path(args.out).is_file():
        raise UsageError(f"--out {args.out} is a file; give a run directory")
    bar, hooks = _progress(cfg.train.max_steps, args.no_progress)
    try:
        results = run_recipe(
            args.config,
            args.out,
            data=args.data,
            device=args.device,
            overrides=overrides,
            hooks=hooks,
            experiment=experiment,
        )
    except RecipeStoppedError as e:
        print(f"aiayn recipe: {e}", file=sys.stderr)
        return {"SIGTERM": 143, "SIGINT": 130}[e.signal_name]
    finally:
        bar.close()
    if results.get("rank", 0):  # under torchrun: rank 0 reports for the job
        return 0
    print(format_results(results))
    print(f"results: {Path(args.out) / 'results.json'}")
    return 3 if results.get("not_trained_enough") else 0
