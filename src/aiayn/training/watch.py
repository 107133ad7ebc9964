"""Watching a long run: validation BLEU every N steps beside the perplexity, the best
checkpoint's bookkeeping, and TensorBoard event files beside train_log.jsonl.

None of it changes the training: decoding runs under no_grad in eval mode and draws no
random numbers (dropout is reseeded before every step anyway), so a run with valid BLEU
on trains the same weights as one without.

- Valid BLEU: the first `train.valid_bleu_sentences` pairs of the prepared validation
  split, the same ones every time, decoded from their prepared subword ids by the search
  `aiayn translate` uses (`decoding.search.beam_search`, batched by
  `decode.max_tokens`, output length <= decode.max_len_a x input + decode.max_len_b),
  detokenized by the data's sentencepiece model and scored by sacreBLEU against the raw
  reference text the prepared manifest names (checked against its sha256), or, when
  that file is gone or changed, against the reference subwords decoded (the log says
  which: "valid_bleu_ref").
- The best checkpoint: `best_metric_name` and `is_better` decide; the trainer writes it.
- TensorBoard (`Board`): every number of train_log.jsonl's records under a fixed tag, per
  step, written by PyTorch's SummaryWriter into RUN/tensorboard/; without the tensorboard
  package a one-line warning, and train_log.jsonl stays the record.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiayn.config import EOS_ID, DecodeConfig, TrainConfig
from aiayn.data.corpus import Corpus
from aiayn.data.tokenizer import Vocabulary

log = logging.getLogger(__name__)

#: Where a number of train_log.jsonl goes in TensorBoard (its key -> the scalar's tag).
TB_TAGS = {
    "loss": "train/loss",
    "nll": "train/nll",
    "lr": "train/lr",
    "gnorm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "loss_scale": "train/loss_scale",
    "valid_nll": "valid/nll",
    "valid_ppl": "valid/ppl",
    "valid_bleu": "valid/bleu",
}
TB_DIR = "tensorboard"


# --------------------------------------------------------------------------- valid BLEU
@dataclass
class BleuSubset:
    """The validation pairs scored every time: sources as the model reads them (subword
    ids + EOS) and detokenized references."""

    sources: list[list[int]]
    references: list[str]
    #: "raw" (the text prepare read) or "subwords" (the prepared ids, decoded)
    reference_kind: str
    #: the raw reference file, or why it could not be used
    reference_source: str


def bleu_subset(
    corpus: Corpus,
    tokenizer: Vocabulary,
    manifest: dict[str, Any],
    n: int,
    max_input_len: int,
) -> BleuSubset:
    """The first `n` pairs of the prepared validation split (all of them for n = 0).

    Sources longer than `max_input_len` subwords are cut, as `aiayn translate` cuts them.
    """
    count = len(corpus) if n == 0 else min(n, len(corpus))
    sources = [[*corpus.src(i)[:max_input_len], EOS_ID] for i in range(count)]
    line_numbers = [int(x) for x in corpus.line_numbers[:count]]
    raw, where = _raw_references(manifest)
    if raw is not None and all(1 <= ln <= len(raw) for ln in line_numbers):
        refs = [raw[ln - 1] for ln in line_numbers]
        return BleuSubset(sources, refs, "raw", where)
    if raw is not None:
        where = f"{where} has fewer lines than the prepared validation split"
    refs = [tokenizer.decode(corpus.tgt(i)) for i in range(count)]
    return BleuSubset(sources, refs, "subwords", where)


def _raw_references(manifest: dict[str, Any]) -> tuple[list[str] | None, str]:
    """The validation split's raw target text prepare recorded, or None and the reason."""
    from aiayn.files import InputError, read_lines, sha256_file

    try:
        entry = manifest["inputs"]["valid"]["tgt"]
        path, digest = Path(entry["path"]), entry["sha256"]
    except (KeyError, TypeError):
        return None, "the manifest names no raw validation text"
    if not path.is_file():
        return None, f"{path} (named by the manifest) is missing"
    if sha256_file(path) != digest:
        return None, f"{path} changed since prepare (sha256 differs from the manifest's)"
    try:
        return list(read_lines(path, on_bad_utf8="replace")), str(path)
    except (OSError, InputError) as e:
        return None, f"{path} is unreadable ({e})"


def decode_ids(
    model: Any,
    sources: list[list[int]],
    beam: int,
    cfg: DecodeConfig,
    device: torch.device,
    dtype: str,
) -> list[list[int]]:
    """The best output (subword ids, no BOS/EOS) of each source, in order: `beam_search`
    over length-sorted batches of at most `cfg.max_tokens` source tokens, in eval mode
    under the training dtype's autocast; the model's mode is restored after."""
    from aiayn.data.batching import decode_batches
    from aiayn.decoding.search import beam_search
    from aiayn.decoding.translate import pad_batch
    from aiayn.training.precision import autocast

    outputs: list[list[int]] = [[] for _ in sources]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, dtype):
            for rows in decode_batches([len(s) - 1 for s in sources], cfg.max_tokens):
                src = pad_batch([sources[i] for i in rows], device)
                hyps = beam_search(model, src, beam, cfg.alpha, cfg.max_len_a, cfg.max_len_b)
                for i, h in zip(rows, hyps, strict=True):
                    outputs[i] = h[0].tokens if h else []
    finally:
        model.train(was_training)
    return outputs


def valid_bleu(
    model: Any,
    subset: BleuSubset,
    tokenizer: Vocabulary,
    beam: int,
    cfg: DecodeConfig,
    device: torch.device,
    dtype: str,
) -> tuple[dict[str, float], list[str], str]:
    """Decode the subset and score it: ({"valid_bleu", "valid_bleu_seconds"}, the
    detokenized hypotheses, sacreBLEU's signature)."""
    from aiayn.scoring.bleu import sacrebleu_only

    t0 = time.perf_counter()
    ids = decode_ids(model, subset.sources, beam, cfg, device, dtype)
    hyps = [tokenizer.decode(x).replace("\n", " ") for x in ids]
    bleu, signature = sacrebleu_only(hyps, subset.references)
    return {"valid_bleu": bleu, "valid_bleu_seconds": time.perf_counter() - t0}, hyps, signature


def bleu_due(t: TrainConfig, step: int, final: bool = False) -> bool:
    """Whether the validation after step `step` measures BLEU too (the run's last
    validation always does, when BLEU is on)."""
    n = t.valid_bleu_interval_steps
    return n > 0 and (step % n == 0 or final)


# --------------------------------------------------------------------------- best checkpoint
def best_metric_name(t: TrainConfig) -> str | None:
    """The record key that chooses checkpoint_best.pt ("valid_bleu", "valid_ppl"), or None."""
    if t.best_metric == "ppl":
        return "valid_ppl"
    if t.best_metric == "bleu" or (t.best_metric == "auto" and t.valid_bleu_interval_steps > 0):
        return "valid_bleu"
    return None


def patience_metric(t: TrainConfig) -> str:
    """The record key train.patience watches: train.best_metric's ("valid_bleu" where BLEU
    is measured, "valid_ppl"), else "valid_nll" (best_metric "none", or "auto" without
    valid BLEU)."""
    return best_metric_name(t) or "valid_nll"


def is_better(metric: str, value: float, best_metric: str, best_value: float) -> bool:
    """Whether `value` of `metric` beats the best so far: higher BLEU, lower PPL; the
    first value of a metric (or one measured by another metric before) always does; a
    tie keeps the earlier checkpoint."""
    if not math.isfinite(value):
        return False
    if best_metric != metric or not math.isfinite(best_value):
        return True
    return value > best_value if metric == "valid_bleu" else value < best_value


# --------------------------------------------------------------------------- TensorBoard
class Board:
    """TensorBoard event files in `log_dir`: each numeric value of a train_log.jsonl record
    whose key TB_TAGS lists, at the record's step. The writer opens at the first record
    (a finished run resumed writes nothing); a resumed run purges the events of the steps
    it redoes (`purge_step`), as train_log.jsonl's readers keep the later pass."""

    def __init__(self, log_dir: str | Path, enabled: bool, purge_step: int | None = None):
        self.log_dir = Path(log_dir)
        self.enabled = enabled
        self.purge_step = purge_step
        self._writer: Any = None

    def _open(self) -> Any:
        if self._writer is None and self.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                log.warning(
                    "no TensorBoard event files (%s): pip install 'aiayn[watch]', or set "
                    "train.tensorboard=false; train_log.jsonl stays the record",
                    e,
                )
                self.enabled = False
                return None
            self._writer = SummaryWriter(str(self.log_dir), purge_step=self.purge_step)
        return self._writer

    def write(self, record: dict[str, Any]) -> None:
        """Add `record`'s scalars (nothing for event records or ones without a step)."""
        step = record.get("step")
        if not self.enabled or not isinstance(step, int):
            return
        values = {
            tag: float(record[key])
            for key, tag in TB_TAGS.items()
            if isinstance(record.get(key), int | float) and not isinstance(record[key], bool)
        }
        if not values:
            return
        writer = self._open()
        if writer is None:
            return
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class TrainLog:
    """train_log.jsonl (rank 0 only), with each record also written to TensorBoard
    (`Board`, opened once the run knows where it resumes: `open_board`). Records made
    before the first update (the precision chosen, a fresh loss scaler on resume) wait in
    `later` until `flush_later`, so that they follow a resume's truncation point."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.path = run_dir / "train_log.jsonl"
        self.is_main = is_main
        self.board: Board | None = None
        self._later: list[dict[str, Any]] = []

    def open_board(self, enabled: bool, purge_step: int | None) -> Board:
        self.board = Board(self.path.parent / TB_DIR, enabled and self.is_main, purge_step)
        return self.board

    def write(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            self.board.write(record)  # the same numbers, for TensorBoard

    def later(self, record: dict[str, Any]) -> None:
        """Write `record` as the first update starts (`flush_later`), at its step."""
        self._later.append(record)

    def flush_later(self, step: int) -> None:
        for record in self._later:
            self.write({"step": step, **record})
        self._later.clear()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
