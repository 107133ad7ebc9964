"""Training steps on a recipe's real, length-bucketed batches, epoch by epoch.

    aiayn prepare ... --out DATA        # or a recipe's RUN/data/prepared
    python benchmarks/real_batches.py DATA --config configs/multi30k-en-de.toml --epochs 2
    python benchmarks/real_batches.py DATA --config configs/multi30k-en-de.toml --packed
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 python benchmarks/real_batches.py DATA ...
    python benchmarks/real_batches.py DATA ... --bpe-dropout 0.1   # new shapes every epoch

`aiayn bench train` times one batch shape over and over; a real epoch has many (the En->De
recipe: 178 batch shapes, ~4,400 distinct matrix products), and on the CPU each new bf16
product shape is a oneDNN kernel compiled once and cached. This times what a training run
sees: the recipe's model, optimizer and batches (forward, loss, backward, Adam; no
validation or checkpoints), and prints the mean step time and peak memory per epoch. The
second line leaves padding out of the position-wise layers (`train.pack_padding`; the
recipes train on the whole padded batches, `--padded`), the third shows oneDNN's default
kernel cache (aiayn sets a larger one on import).
Run it with the allocator settings the `aiayn` command sets for itself (MALLOC_* in
`aiayn.cli.environment`), or page faults blur the comparison on VMs like ours.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import replace

import torch

import aiayn  # noqa: F401  # sets oneDNN's kernel cache before the first product
import aiayn.fast  # noqa: F401  # the speed paths on (compiled loss and BPE-dropout: aiayn.speed)
from aiayn.config import get_preset, load_experiment
from aiayn.data.batching import collate, token_batches
from aiayn.data.bpe_dropout import BPEDropout
from aiayn.data.corpus import load_corpus
from aiayn.data.tokenizer import Tokenizer
from aiayn.model import Transformer
from aiayn.training.loss import generator_loss
from aiayn.training.trainer import make_optimizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="a prepared data directory (aiayn prepare)")
    p.add_argument("--config", help="experiment file (default: the tiny preset)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-batches", type=int, default=0, help="per epoch; 0 = all")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--padded",
        action="store_true",
        help="the whole padded batches (train.pack_padding = false)",
    )
    how.add_argument(
        "--packed",
        action="store_true",
        help="padding left out (train.pack_padding = true); default: the config's",
    )
    p.add_argument(
        "--bpe-dropout",
        type=float,
        default=None,
        help="re-segment each epoch with this BPE-dropout p (default: the config's)",
    )
    args = p.parse_args()

    cfg = load_experiment(args.config)[0] if args.config else get_preset("tiny")
    vocab = Tokenizer.load(f"{args.data}/spm.model").vocab_size
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    if args.bpe_dropout is not None:
        cfg = replace(cfg, train=replace(cfg.train, bpe_dropout=args.bpe_dropout))
    corpus = load_corpus(args.data, "train")
    t = cfg.train
    resegment = (
        BPEDropout(corpus, Tokenizer.load(f"{args.data}/spm.model"), t.bpe_dropout, t.max_len)
        if t.bpe_dropout > 0
        else None
    )
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model).train()
    packed = args.packed or (cfg.train.pack_padding and not args.padded)
    model.pack_padding = None if packed else False  # None: packed, training on the CPU
    model.use_cpu_kernels(cfg.train.cpu_kernels)  # as the trainer does
    opt = make_optimizer(model, cfg.train)
    bf16 = cfg.train.dtype == "bf16"
    print(
        f"{cfg.train.dtype}, max_tokens {cfg.train.max_tokens}, "
        f"{'packed' if packed else 'padded'} batches, cpu_kernels {cfg.train.cpu_kernels}, "
        f"oneDNN kernel cache "
        f"{os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY', 'default')}, BPE-dropout "
        f"{t.bpe_dropout}"
    )
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for epoch in range(args.epochs):
        if resegment is not None:  # the seed the trainer uses for this epoch
            corpus = resegment.epoch(t.seed * 1_000_003 + epoch)
        order = token_batches(
            corpus.src_lens, corpus.tgt_lens, cfg.train.max_tokens, seed=cfg.train.seed, epoch=epoch
        )
        batches = [collate(corpus, b) for b in order[: args.max_batches or None]]
        shapes = {(tuple(b.src.shape), tuple(b.tgt_in.shape)) for b in batches}
        new, seen = len(shapes - seen), seen | shapes
        t0 = time.perf_counter()
        tokens = 0
        for b in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                features = model(b.src, b.tgt_in, features_only=True)
                loss, _ = generator_loss(
                    features,
                    model.generator.weight,
                    b.tgt_out,
                    cfg.train.eps_ls,
                    cpu_kernels=cfg.train.cpu_kernels,
                )
            (loss / b.tgt_tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += b.src_tokens + b.tgt_tokens
        dt = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"epoch {epoch}: {len(batches)} steps, {dt / len(batches) * 1e3:.1f} ms a step, "
            f"{tokens / dt:,.0f} tokens/s, peak RSS {rss:.2f} GiB, {len(shapes)} batch "
            f"shapes ({new} not seen before)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
