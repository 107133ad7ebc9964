"""The parsers of the stages that make a model: data, prepare, train, average."""

from __future__ import annotations

import argparse

from aiayn.cli.formatting import add_config_args, command_parser, from_preset
from aiayn.config import TrainConfig
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks import datasets


def add_data(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "data",
        "copy or download a corpus, each file checked against a pinned hash",
        """\
multi30k: the raw text files of Multi30k task 1 (translation), each checked against a
pinned sha256. ptb: a Penn Treebank made ready for parsing (section 6.3): for each split
(train, dev, test) SPLIT.trees (one cleaned tree a line: no -NONE- traces or the
constituents they empty, no function tags or indices), SPLIT.words (the sentence, the
parser's input) and SPLIT.lin (the linearized tree, its output), plus manifest.json.
--from takes the NLTK sample's treebank.zip (or that zip unpacked: split by file,
0001-0159 / 0160-0179 / 0180-0199), the LDC release's folder holding wsj/SS/*.mrg
(sections 02-21 / 22 / 23), or a folder of one-tree-per-line files as parsers ship them
(02-21.10way.clean, 22.auto.clean, 23.auto.clean; or name each split's file with --train,
--dev and --test); without --from the NLTK sample is downloaded and verified.
wmt14: the paper's WMT 2014 data (section 5.1) as aligned plain text, --pair en-de
(Europarl v7 + Common Crawl + News Commentary v9: ~4.5M pairs; ~1.7 GB to download,
~3 GB of disk in all) or en-fr (those + UN + Giga-fren: ~40.8M pairs before cleaning;
~6.6 GB to download, ~20 GB of disk): OUT/train.{en,XX}, valid.* (newstest2013, 3000
pairs), test.* (newstest2014 full, 3003: sacreBLEU's wmt14/full), wmt14.json (what
came from where, hashes, counts) and OUT/downloads/ (the archives: delete them after).
Each archive is checked against a hash published by tensorflow_datasets or sacreBLEU;
an interrupted download continues on the next run; a run that finished is not redone.

examples:
  aiayn data multi30k --out data/multi30k
  aiayn data multi30k --from ../shared/data/multi30k --out data/multi30k
  aiayn data multi30k --out data/multi30k --splits train,val,test_2016_flickr \\
      --langs en,de
  aiayn data ptb --from ../shared/data/ptb-sample/treebank.zip --out data/ptb
  aiayn data ptb --from /corpora/LDC99T42/parsed/mrg --out data/wsj
  aiayn data ptb --from /corpora/wsj-clean --out data/wsj
  aiayn data ptb --train train.txt --dev dev.txt --test test.txt --out data/mine
  aiayn data wmt14 --pair en-de --out data/wmt14-en-de
  aiayn data wmt14 --pair en-fr --from /mirror/statmt --out data/wmt14-en-fr""",
    )
    p.add_argument(
        "dataset",
        choices=datasets(),
        help="the corpus: multi30k (task 1), ptb (a Penn Treebank, for parsing) or wmt14 "
        "(the paper's En-De / En-Fr data)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="directory to write the files into (created)",
    )
    p.add_argument(
        "--from",
        dest="from_dir",
        metavar="PATH",
        help="multi30k: copy from this local directory instead of downloading; files "
        "missing there are skipped with a warning. ptb: the treebank, a zip or a folder. "
        "wmt14: a mirror directory holding the archives under their published names "
        "(training-parallel-europarl-v7.tgz, ..., test-full.tgz), read there and verified, "
        "not copied (default: download; for ptb, NLTK's sample)",
    )
    for name, example in (
        ("train", "02-21.10way.clean"),
        ("dev", "22.auto.clean"),
        ("test", "23.auto.clean"),
    ):
        p.add_argument(
            f"--{name}",
            metavar="FILE",
            help=f"ptb: the {name} split as one tree a line (e.g. {example}; with or without "
            "an outer (TOP ...) or ( ...)); relative to --from when that is a folder. Give "
            "all three, or none (a --from folder holding the usual names is read as such)",
        )
    p.add_argument(
        "--split",
        choices=["auto", "sample", "ldc"],
        help="ptb: which split by file: sample (NLTK's 199 files), ldc (the LDC release's "
        "sections) or auto (by the files found; the default)",
    )
    p.add_argument(
        "--splits",
        help="multi30k: comma-separated splits, e.g. train,val,test_2016_flickr "
        "(default: all published)",
    )
    p.add_argument(
        "--langs",
        help="multi30k: comma-separated languages, e.g. en,de (default: all published "
        "for each split)",
    )
    p.add_argument(
        "--pair",
        choices=["en-de", "en-fr"],
        help="wmt14 (required there): the language pair, en-de or en-fr (no default); "
        "the outputs are SPLIT.en and SPLIT.de or SPLIT.fr",
    )
    return p


def add_prepare(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "prepare",
        "learn a shared BPE vocabulary (or one per language) and encode the splits",
        """\
The vocabulary (sentencepiece BPE) is learned on the training text of both languages
(--vocab separate: one per language, each on its own side).
Writes spm.model, train.pt, valid.pt, test.pt and manifest.json to --out. Sides with
different line counts are refused before any work. Only training pairs are filtered.

examples:
  aiayn prepare -s en -t de --trainpref data/multi30k/train \\
      --validpref data/multi30k/val --testpref data/multi30k/test_2016_flickr \\
      --out data/multi30k-en-de --vocab-size 8000
  aiayn prepare -s en -t de --trainpref corpus/train --out data/lc --lowercase
  aiayn prepare -s words -t linw --trainpref data/ptb/train --validpref data/ptb/dev \\
      --out data/ptb-prepared --vocab-size 4000 --max-len 512 --no-split-by-script
  aiayn prepare --streaming -s en -t de --trainpref data/wmt14-en-de/train \\
      --validpref data/wmt14-en-de/valid --testpref data/wmt14-en-de/test \\
      --out data/wmt14-en-de-prepared --vocab-size 37000
  aiayn prepare --streaming -s en -t fr --trainpref data/wmt14-en-fr/train \\
      --validpref data/wmt14-en-fr/valid --testpref data/wmt14-en-fr/test \\
      --out data/wmt14-en-fr-prepared --vocab-size 32000 --model-type unigram""",
    )
    p.add_argument(
        "--source-lang",
        "-s",
        required=True,
        metavar="LANG",
        help="source language: the LANG of PREFIX.LANG[.gz]",
    )
    p.add_argument(
        "--target-lang",
        "-t",
        required=True,
        metavar="LANG",
        help="target language: the LANG of PREFIX.LANG[.gz]",
    )
    p.add_argument(
        "--trainpref",
        required=True,
        metavar="PREFIX",
        help="training text: PREFIX.LANG or PREFIX.LANG.gz for both languages, one "
        "sentence a line; the vocabulary is learned on it",
    )
    p.add_argument(
        "--validpref",
        metavar="PREFIX",
        help="validation text, same form (default: no validation split)",
    )
    p.add_argument(
        "--testpref", metavar="PREFIX", help="test text, same form (default: no test split)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a prepared set already in --out (refused otherwise: its vocabulary "
        "may be what trained models need)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=RecipeConfig.vocab_size,
        help="subword pieces in the shared vocabulary (with --vocab separate: in each)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=TrainConfig.max_len,
        help="drop training pairs with a side longer than this many subwords",
    )
    p.add_argument(
        "--max-len-ratio",
        type=float,
        default=TrainConfig.max_len_ratio,
        help="drop training pairs whose sides' lengths (subwords) differ by more than this ratio",
    )
    p.add_argument(
        "--on-empty",
        choices=["skip", "error"],
        default="skip",
        help="a pair with an empty or blank side: skip drops it, error fails",
    )
    p.add_argument(
        "--on-bad-utf8",
        choices=["error", "skip"],
        default="error",
        help="invalid UTF-8: error fails naming file, line and byte; skip drops the pair",
    )
    p.add_argument(
        "--lowercase",
        action="store_true",
        help="a vocabulary that lowercases what it encodes (so a model trained on "
        "it lowercases any input it translates)",
    )
    p.add_argument(
        "--no-split-by-script",
        dest="split_by_script",
        action="store_false",
        help="let a subword span a bracket and letters, so that each token of a "
        "linearized tree, like (NP or )VP, is one piece (parsing needs it)",
    )
    p.add_argument(
        "--model-type",
        choices=["bpe", "unigram"],
        default=RecipeConfig.vocab_model,
        help="the subword model: bpe (the paper's En-De: 37K shared BPE) or unigram "
        "(sentencepiece's unigram LM, a word-piece-like vocabulary as for the paper's "
        "En-Fr; its trainer took ~4x BPE's memory and ~15x its time per sentence here) "
        "(default: bpe)",
    )
    p.add_argument(
        "--vocab",
        choices=["shared", "separate"],
        default="shared",
        help="shared: the paper's one vocabulary learned on both sides, one matrix for "
        "both embeddings and the pre-softmax projection; separate: a vocabulary for each "
        "language learned on its own side (for pairs in different scripts), stored as one "
        "spm.model; models trained on it tie no embedding (checkpoints and exports carry "
        "both vocabularies)",
    )
    g = p.add_argument_group(
        "streaming (WMT-sized corpora)",
        "--streaming reads the text line by line in one pass per stage, learns the "
        "vocabulary from a sample and encodes in --workers processes into memory-mapped "
        "arrays (SPLIT.*.npy, manifest format 2) that training reads without loading them: "
        "memory stays bounded (1.5 GB with the defaults, measured at 4.5M and 9M pairs) "
        "whatever the corpus. Same "
        "cleaning and filters as without it. Not automatic: without --streaming, a "
        "training text over 1 GB is prepared in memory after a warning.",
    )
    g.add_argument(
        "--streaming",
        action="store_true",
        help="prepare in bounded memory into memory-mapped arrays (default: off, "
        "in-memory train.pt)",
    )
    g.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="--streaming: encoding processes, 0 for this process alone (default: the "
        "number of CPUs)",
    )
    g.add_argument(
        "--spm-sample",
        type=int,
        metavar="N",
        help="--streaming: sentences (both languages) the vocabulary is learned from, "
        "drawn uniformly from the training pairs with --seed; the corpus is used whole "
        "when smaller (default: 2000000 for bpe, ~1.3 GB; 500000 for unigram, whose "
        "trainer took 3.4 GB for 1000000)",
    )
    g.add_argument(
        "--spm-threads",
        type=int,
        metavar="N",
        help="--streaming: sentencepiece trainer threads (default: the number of CPUs)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seeds sentencepiece and --streaming's sample of sentences (default: 1)",
    )
    return p


def add_train(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "train",
        "train a model, or resume its run directory",
        """\
The configuration is a preset or a --config file, then the flags, then each --set.

Running the same command again resumes from the newest valid checkpoint (bitwise on
CPU). A changed model is refused; changed optimizer or batching settings need
--reset-optimizer or --reset-dataloader; budgets and intervals may change freely. SIGTERM
or Ctrl-C saves a checkpoint and stops (exit 143 or 130). Several processes or GPUs:
`torchrun --nproc-per-node=K -m aiayn train ...` (DistributedDataParallel; only rank 0
writes). --dump-config lists every key --set can change; the README describes
the ones beyond the paper (divergence, patience, rdrop_alpha, bpe_dropout ...).

examples:
  aiayn train data/multi30k-en-de --out runs/tiny --preset tiny \\
      --max-minutes 10
  aiayn train data/multi30k-en-de --out runs/p3 \\
      --config configs/multi30k-en-de.toml --set P_drop=0.3 \\
      --set train.dtype=fp32
  aiayn train data/multi30k-en-de --out runs/pre --preset tiny \\
      --set model.norm=pre      # pre-LN: x + Sublayer(LN(x)), final LN per stack
  aiayn train data/multi30k-en-de --out runs/es --config configs/multi30k-en-de.toml \\
      --set train.valid_bleu_interval_steps=1000 \\
      --set train.patience=3    # stop after 3 valid BLEUs in a row without a better one
  torchrun --nproc-per-node=8 -m aiayn train data/wmt14 --out runs/base \\
      --device cuda""",
    )
    p.add_argument("data", metavar="DATA", help="directory made by `aiayn prepare`")
    p.add_argument(
        "--out",
        required=True,
        metavar="RUN",
        help="run directory: config.json, train_log.jsonl, checkpoint_<step>.pt "
        "(each with a .sha256), checkpoint_last.pt; resumes if it has "
        "checkpoints",
    )
    add_config_args(p)
    p.add_argument(
        "--max-steps",
        type=int,
        metavar="STEPS",
        help="stop after this many optimizer updates " + from_preset("train.max_steps"),
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        metavar="MINUTES",
        help="training wall-clock budget in minutes, counted across resumes; 0: none "
        + from_preset("train.max_minutes"),
    )
    p.add_argument(
        "--save-interval-steps",
        type=int,
        metavar="STEPS",
        help="save a checkpoint every this many steps; 0: by time only "
        + from_preset("train.save_interval_steps"),
    )
    p.add_argument(
        "--save-interval-minutes",
        type=float,
        metavar="MINUTES",
        help="save a checkpoint every this many minutes (the paper: 10) "
        + from_preset("train.save_interval_minutes"),
    )
    p.add_argument(
        "--valid-interval-steps",
        type=int,
        metavar="STEPS",
        help="validation loss every this many steps " + from_preset("train.valid_interval_steps"),
    )
    p.add_argument(
        "--keep-last",
        type=int,
        metavar="N",
        help="numbered checkpoints kept, older ones deleted " + from_preset("train.keep_last"),
    )
    p.add_argument(
        "--seed",
        type=int,
        help="random seed: initialisation, batch order, dropout " + from_preset("train.seed"),
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="TOKENS",
        help="batch size in subword tokens per side (source and target each) of one "
        "process, before accumulation; with --global-batch-tokens, the most one process "
        "takes in a batch (its memory) " + from_preset("train.max_tokens"),
    )
    p.add_argument(
        "--update-freq",
        type=int,
        metavar="N",
        help="gradient accumulation: batches per optimizer update (effective batch: "
        "max-tokens x N x processes; with --global-batch-tokens, the least "
        "accumulation) " + from_preset("train.update_freq"),
    )
    p.add_argument(
        "--global-batch-tokens",
        type=int,
        metavar="TOKENS",
        help="the step's batch in subword tokens per side over all processes and "
        "accumulation (the paper: 25000), the same under torchrun on any number of "
        "ranks: each global batch is split into ranks x accumulation slices, "
        "accumulation = max(update-freq, ceil(TOKENS / (ranks x max-tokens))), so "
        "max-tokens caps one rank's batch; a resume on another number of ranks keeps "
        "the batch and the data position exactly; 0: off, max-tokens is per rank "
        + from_preset("train.global_batch_tokens"),
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16", "auto"],
        help="training precision (the master weights and Adam stay fp32); auto: bf16 on "
        "a GPU that has it, fp16 on one that does not, and on the CPU what this machine "
        "trains fastest in (bf16 with AMX or AVX-512 BF16, fp32 where bf16 would be "
        "emulated, e.g. AVX2-only CPUs; `aiayn info` shows the choice); an explicit "
        "bf16 on a CPU that emulates it runs, with a warning and the measured factor; "
        "fp16 (for GPUs without bf16: P100, V100, T4) scales the loss dynamically "
        "(PyTorch's GradScaler: 2^16 at the start, halved and the step skipped on an "
        "overflow, doubled after 2000 clean steps), and is very slow on CPUs "
        + from_preset("train.dtype"),
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, cuda:1 ...; under torchrun with cuda, each rank takes cuda:LOCAL_RANK",
    )
    p.add_argument(
        "--reset-optimizer",
        action="store_true",
        help="on resume: keep the weights, start a fresh optimizer and schedule "
        "(allows changed optimizer settings)",
    )
    p.add_argument(
        "--reset-dataloader",
        action="store_true",
        help="on resume with changed data or batching settings: start a new epoch",
    )
    p.add_argument(
        "--dump-config",
        action="store_true",
        help="print the effective config as JSON and exit without training",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (step, loss, learning rate, tokens/s)",
    )
    return p


def add_average(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "average",
        "average checkpoints into one (section 6.1)",
        """\
examples:
  aiayn average runs/tiny --last 5 --out runs/tiny/averaged.pt
  aiayn average runs/a/checkpoint_9000.pt runs/a/checkpoint_10000.pt \\
      --out runs/a/avg.pt""",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a run directory (its newest --last checkpoints), or checkpoint files",
    )
    p.add_argument(
        "--last",
        type=int,
        default=RecipeConfig.average_last,
        metavar="N",
        help="with a run directory: how many of its newest checkpoints",
    )
    p.add_argument("--out", required=True, metavar="FILE.pt", help="the averaged checkpoint")
    p.add_argument(
        "--force",
        action="store_true",
        help="allow averaging checkpoints of different runs, and replacing an --out file "
        "that is not an earlier average (a training checkpoint): both refused otherwise",
    )
    return p
