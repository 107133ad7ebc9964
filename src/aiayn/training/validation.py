"""Validation (section 6): the unsmoothed NLL per target token and its perplexity; and
`Validator`, the run's validations as one object the `Trainer` holds (valid BLEU where
due, checkpoint_best.pt, early-stopping patience)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from aiayn import checkpoints as ckpt_lib
from aiayn.config import Config
from aiayn.data.batching import collate, token_batches
from aiayn.data.corpus import Corpus
from aiayn.data.tokenizer import Vocabulary
from aiayn.model import Transformer
from aiayn.training.distributed import DistContext
from aiayn.training.loss import generator_loss
from aiayn.training.persistence import Checkpoints
from aiayn.training.precision import autocast
from aiayn.training.state import Hooks, TrainState
from aiayn.training.watch import (
    BleuSubset,
    TrainLog,
    best_metric_name,
    bleu_due,
    bleu_subset,
    is_better,
    patience_metric,
    valid_bleu,
)

__all__ = ["Validator", "autocast", "validate"]

log = logging.getLogger("aiayn.training.trainer")  # the trainer's voice, as before the split


@torch.no_grad()
def validate(
    model: Transformer,
    corpus: Corpus,
    max_tokens: int,
    device: torch.device,
    dtype: str = "fp32",
    cpu_kernels: bool = True,
) -> dict[str, float]:
    """Validation NLL per target token and perplexity (unsmoothed, as the paper reports).
    `cpu_kernels`: see `loss.generator_loss`."""
    was_training = model.training
    model.eval()
    nll_sum, n_tok = 0.0, 0
    for idx in token_batches(
        corpus.src_lens, corpus.tgt_lens, max_tokens, seed=0, epoch=0, shuffle=False
    ):
        b = collate(corpus, idx).to(device)
        with autocast(device, dtype):
            features = model(b.src, b.tgt_in, features_only=True)
            _, nll = generator_loss(
                features, model.generator.weight, b.tgt_out, 0.0, cpu_kernels=cpu_kernels
            )
        nll_sum += float(nll)
        n_tok += b.tgt_tokens
    model.train(was_training)
    mean_nll = nll_sum / max(n_tok, 1)
    return {"valid_nll": mean_nll, "valid_ppl": math.exp(min(mean_nll, 50.0))}


class Validator:
    """Validation at the trainer's intervals: NLL and PPL on rank 0, valid BLEU where due
    (`watch.bleu_due`), checkpoint_best.pt kept (train.best_metric), and the patience
    count of early stopping. Under DDP the other ranks wait at a barrier while rank 0
    decodes."""

    def __init__(
        self,
        cfg: Config,
        model: Transformer,
        valid_data: Corpus | None,
        tokenizer: Vocabulary,
        manifest: dict[str, Any],
        dist: DistContext,
        device: torch.device,
        checkpoints: Checkpoints,
        train_log: TrainLog,
        hooks: Hooks,
    ) -> None:
        self.cfg, self.model, self.valid_data = cfg, model, valid_data
        self.tokenizer, self.manifest = tokenizer, manifest
        self.dist, self.device = dist, device
        self.checkpoints, self.train_log, self.hooks = checkpoints, train_log, hooks
        self.bleu_subset: BleuSubset | None = None  # built at the first valid BLEU

    def validate(self, state: TrainState, final: bool = False) -> dict[str, float]:
        """Validation NLL and PPL on rank 0, with valid BLEU where due (`final`: the run's
        last validation), and checkpoint_best.pt kept."""
        if self.valid_data is None:
            return {}
        t = self.cfg.train
        with_bleu = bleu_due(t, state.step, final)
        if not self.dist.is_main:
            if with_bleu:
                self.dist.barrier()
            return {}
        metrics = validate(
            self.model, self.valid_data, t.max_tokens, self.device, t.dtype, t.cpu_kernels
        )
        if with_bleu:
            metrics.update(self._valid_bleu(state))
        state.best_valid_nll = min(state.best_valid_nll, metrics["valid_nll"])
        record: dict[str, Any] = {"step": state.step, "time": state.train_seconds}
        record.update(metrics)
        if with_bleu and self.bleu_subset is not None:
            record["valid_bleu_ref"] = self.bleu_subset.reference_kind
        best = self._keep_best(state, metrics)
        if best:
            record["best"] = True
        self.train_log.write(record)
        if self.train_log.board is not None:
            self.train_log.board.flush()
        log.info(
            "step %d: valid nll %.4f, ppl %.2f%s%s",
            state.step,
            metrics["valid_nll"],
            metrics["valid_ppl"],
            f", BLEU {metrics['valid_bleu']:.2f}" if with_bleu else "",
            f" (the best {state.best_checkpoint_metric} so far: {ckpt_lib.BEST_NAME})"
            if best
            else "",
        )
        if self.hooks.on_valid:
            self.hooks.on_valid(state.step, metrics)
        if with_bleu:
            self.dist.barrier()
        return metrics

    def _valid_bleu(self, state: TrainState) -> dict[str, float]:
        """sacreBLEU of the fixed validation subset, decoded now (`watch.valid_bleu`); the
        first time, the subset is built and an event record says what is scored."""
        t = self.cfg.train
        first = self.bleu_subset is None
        if self.bleu_subset is None:
            assert self.valid_data is not None
            limit = min(self.cfg.decode.max_input_len, self.cfg.model.max_positions - 1)
            self.bleu_subset = bleu_subset(
                self.valid_data, self.tokenizer, self.manifest, t.valid_bleu_sentences, limit
            )
        subset = self.bleu_subset
        metrics, _, signature = valid_bleu(
            self.model,
            subset,
            self.tokenizer,
            t.valid_bleu_beam,
            self.cfg.decode,
            self.device,
            t.dtype,
        )
        if first:
            if subset.reference_kind != "raw":
                log.warning(
                    "valid BLEU is scored against the reference subwords decoded, not the "
                    "raw text: %s",
                    subset.reference_source,
                )
            self.train_log.write(
                {
                    "step": state.step,
                    "event": "valid_bleu",
                    "sentences": len(subset.sources),
                    "beam": t.valid_bleu_beam,
                    "reference": subset.reference_kind,
                    "reference_source": subset.reference_source,
                    "signature": signature,
                }
            )
        return metrics

    def _keep_best(self, state: TrainState, metrics: dict[str, float]) -> bool:
        """Write checkpoint_best.pt when this validation beats the best so far by
        train.best_metric (`watch.is_better`); the state records what it has to beat."""
        name = best_metric_name(self.cfg.train)
        s = state
        if name is None or name not in metrics:
            return False
        if not is_better(name, metrics[name], s.best_checkpoint_metric, s.best_checkpoint_value):
            return False
        s.best_checkpoint_step, s.best_checkpoint_metric = s.step, name
        s.best_checkpoint_value = float(metrics[name])
        ckpt_lib.save_best_checkpoint(self.checkpoints.run_dir, self.checkpoints.checkpoint_dict(s))
        return True

    def out_of_patience(self, state: TrainState, final: bool = False) -> bool:
        """Validate; True when `patience` validations in a row brought no better value of
        the watched metric (`watch.patience_metric`: train.best_metric's, valid BLEU where
        it is measured, else validation NLL). A validation that did not measure it (no
        BLEU at this step) neither counts nor resets the count."""
        s = state
        watched = patience_metric(self.cfg.train)
        before = (s.best_checkpoint_metric, s.best_checkpoint_value, s.best_valid_nll)
        metrics = self.validate(state, final)
        if not metrics or watched not in metrics:
            return False
        if watched == "valid_nll":
            improved = metrics["valid_nll"] < before[2]
        else:  # the best checkpoint's metric: what `validate` just compared it with
            improved = is_better(watched, metrics[watched], before[0], before[1])
        s.valid_without_improvement = 0 if improved else s.valid_without_improvement + 1
        patience = self.cfg.train.patience
        if patience and s.valid_without_improvement >= patience:
            log.warning(
                "no better %s in %d validations (patience %d): stopping",
                watched,
                s.valid_without_improvement,
                patience,
            )
            return True
        return False
