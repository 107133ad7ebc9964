"""What several test modules share: small configs, hand-set and trained toy models, and
the crash-and-resume harness. Imported as `helpers` (tests/ is on sys.path via conftest)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from aiayn.config import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    get_preset,
)
from aiayn.data.batching import pad_right
from aiayn.fast import accelerate
from aiayn.model import Transformer
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.trainer import learning_rate, make_optimizer, train

#: The repository, and the Multi30k copy beside it (../shared/data/multi30k).
ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


# --------------------------------------------------------------------------- configs
#: The training tests' model and loop: a one-layer d_model 32 model, tens of steps a second.
SMALL_TRAINING: dict[str, Any] = {
    "N": 1,
    "d_model": 32,
    "d_ff": 64,
    "h": 2,
    "d_k": 16,
    "d_v": 16,
    "P_drop": 0.1,
    "train.max_tokens": 400,
    "max_steps": 40,
    "warmup_steps": 10,
    "save_interval_steps": 5,
    "keep_last": 20,
    "log_interval_steps": 1,
    "valid_interval_steps": 10,
    "dtype": "fp32",
}


def tiny_config(settings: dict[str, Any], **over: Any) -> Any:
    """The tiny preset with `settings`, then `over`, applied as `--set` would."""
    return apply_overrides(get_preset("tiny"), {**settings, **over})


def fast_transformer(cfg: ModelConfig) -> Transformer:
    """The model as training and decoding run it: the paper's with `aiayn.fast` plugged in."""
    return accelerate(Transformer(cfg))


# --------------------------------------------------------------------------- hand-set models
A, B = 4, 5  # the two words of the hand-set table's vocabulary (ids 0-3 are PAD UNK BOS EOS)


class PrefixState:
    """Incremental state of TableModel: the tokens each row has been fed (BOS excluded)."""

    def __init__(self, rows: int) -> None:
        self.prefixes: list[tuple[int, ...]] = [() for _ in range(rows)]

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        self.prefixes = [self.prefixes[i] for i in index.tolist()]


class TableModel:
    """A 'model' whose next-token distribution is a hand-set function of the prefix only."""

    def __init__(
        self,
        table: dict[tuple[int, ...], dict[int, float]],
        default: dict[int, float],
        vocab_size: int = 6,
    ) -> None:
        self.table, self.default, self.vocab_size = table, default, vocab_size
        self.steps = 0

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        return src.float().unsqueeze(-1), (src != PAD_ID)[:, None, None, :]

    def init_state(self, memory: Tensor, max_len: int) -> list[PrefixState]:
        return [PrefixState(memory.size(0))]

    def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list[PrefixState]) -> Tensor:
        self.steps += 1
        state = states[0]
        probs = torch.zeros(tokens.size(0), self.vocab_size, dtype=torch.float64)
        for row, token in enumerate(tokens[:, 0].tolist()):
            if token != BOS_ID:
                state.prefixes[row] = (*state.prefixes[row], token)
            for tok, p in self.table.get(state.prefixes[row], self.default).items():
                probs[row, tok] = p
        return probs.log().float()  # log 0 = -inf: such tokens are impossible


def hand_table() -> TableModel:
    """Greedy takes the likelier first word A into a dead end; beam finds B...; see below."""
    return TableModel(
        table={
            (): {A: 0.5, B: 0.45, EOS_ID: 0.05},
            (A,): {EOS_ID: 0.4, A: 0.35, B: 0.25},
            (B,): {EOS_ID: 0.5, A: 0.45, B: 0.05},
            (B, A): {A: 0.95, EOS_ID: 0.03, B: 0.02},
            (B, A, A): {EOS_ID: 0.99, A: 0.006, B: 0.004},
        },
        default={EOS_ID: 0.5, A: 0.3, B: 0.2},
    )


def tiny_model(seed: int = 0, share_embeddings: bool = True) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        N=2,
        d_model=32,
        h=2,
        d_k=16,
        d_v=16,
        d_ff=64,
        vocab_size=40,
        P_drop=0.0,
        share_embeddings=share_embeddings,
    )
    return accelerate(Transformer(cfg)).eval()


def random_model(vocab: int, seed: int) -> Transformer:
    """An untrained paper model (N=1, d_model 32) over `vocab` ids, in eval mode: what the
    decoding tests search with when only the outputs' form is checked."""
    torch.manual_seed(seed)
    cfg = ModelConfig(N=1, d_model=32, d_ff=64, h=2, d_k=16, d_v=16, vocab_size=vocab)
    return Transformer(cfg).eval()


class EosRamp(Transformer):
    """A random model nudged towards EOS as the output grows, so hypotheses end at varied
    lengths: a random Transformer alone almost never emits EOS, leaving EOS paths untested."""

    def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list) -> Tensor:
        t = states[0].self_cache.length
        logits = super().decode_step(tokens, src_mask, states)
        logits[:, EOS_ID] += 0.5 * t - 3.0
        return logits


def eos_ramp_model() -> EosRamp:
    torch.manual_seed(1)
    cfg = ModelConfig(
        N=2,
        d_model=32,
        h=2,
        d_k=16,
        d_v=16,
        d_ff=64,
        vocab_size=40,
        P_drop=0.0,
        share_embeddings=False,
    )
    return EosRamp(cfg).eval()


def random_src(lengths: list[int], seed: int = 1) -> Tensor:
    """(B, S) source: random word ids, EOS, then PAD."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths) + 1), PAD_ID)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, 40, (n,), generator=g)
        src[i, n] = EOS_ID
    return src


LENGTHS = [3, 7, 5, 9, 1, 12, 4, 6]


# --------------------------------------------------------------------------- the copy task
FIRST_SYMBOL, N_SYMBOLS = EOS_ID + 1, 10  # ids 4..13; 0-3 are PAD, UNK, BOS, EOS
MIN_LEN, MAX_LEN = 3, 8
STEPS, BATCH = 400, 32
MODEL = ModelConfig(
    N=2, d_model=64, d_ff=128, h=4, d_k=16, d_v=16, P_drop=0.0, vocab_size=FIRST_SYMBOL + N_SYMBOLS
)
# Eq. 3 at full scale peaks at 0.0125 for d_model = 64: too high for this small model and
# batch (the loss spikes); 0.15 x Eq. 3 learns the task reliably in 400 steps.
TRAIN = TrainConfig(warmup_steps=100, eps_ls=0.1, lr_scale=0.15)


def random_strings(n: int, g: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=g).tolist()
    return [
        torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + N_SYMBOLS, (k,), generator=g).tolist()
        for k in lengths
    ]


def copy_batch(strings: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """src = x EOS, tgt_in = BOS x, tgt_out = x EOS (teacher forcing, shifted right)."""
    src = pad_right([s + [EOS_ID] for s in strings])
    tgt_in = pad_right([[BOS_ID] + s for s in strings])
    tgt_out = pad_right([s + [EOS_ID] for s in strings])
    return src, tgt_in, tgt_out


def train_copy_model(
    g: torch.Generator, steps: int = STEPS
) -> tuple[Transformer, set[tuple[int, ...]]]:
    model = Transformer(MODEL)
    optimizer = make_optimizer(model, TRAIN)
    seen: set[tuple[int, ...]] = set()
    model.train()
    for step in range(1, steps + 1):
        strings = random_strings(BATCH, g)
        seen.update(map(tuple, strings))
        src, tgt_in, tgt_out = copy_batch(strings)
        loss, _ = label_smoothed_loss(model(src, tgt_in), tgt_out, TRAIN.eps_ls)
        n_tokens = int((tgt_out != 0).sum())
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, MODEL.d_model, TRAIN.warmup_steps, TRAIN.lr_scale)
        optimizer.zero_grad(set_to_none=True)
        (loss / n_tokens).backward()
        optimizer.step()
    return model.eval(), seen


# --------------------------------------------------------------------------- crash and resume
def step_losses(run: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training log line, replays after a resume included."""
    out = []
    for line in (run / "train_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "event" not in rec:
            out.append((rec["step"], rec["loss"]))
    return out


def losses_after_crash_and_resume(
    config: Any, data: Path, root: Path, step: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[int, float], dict[int, float]]:
    """Train `config` uninterrupted in root/full, and in root/resumed crash as `step`
    starts, then resume: each run's loss by step (a replayed step: its later line)."""
    train(config, data, root / "full")
    monkeypatch.setenv("AIAYN_FAULTS", f"raise_at_step={step}")
    with pytest.raises(RuntimeError, match="injected fault"):
        train(config, data, root / "resumed")
    monkeypatch.delenv("AIAYN_FAULTS")
    train(config, data, root / "resumed")
    return dict(step_losses(root / "full")), dict(step_losses(root / "resumed"))


# --------------------------------------------------------------------------- the command line
def cli(*argv: str | Path) -> tuple[int, str, str]:
    """`aiayn ARGV` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from aiayn.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(err: str, *fragments: str) -> None:
    """stderr holds one `error:` line, no traceback, and it names each fragment."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


# --------------------------------------------------------------------------- a checkpoint
def random_checkpoint(path: Path, seed: int = 0, **model: Any) -> Path:
    """A checkpoint of an untrained tiny model (N=2, d_model 32, P_drop 0, `model` settings
    on top) with a 60-subword vocabulary learned from letters: for what loads, decodes and
    scores files, not for what it says. Decoding: beam 4, alpha 0.6, output <= 8 subwords."""
    import random

    from aiayn.checkpoints.io import FORMAT, save_checkpoint_file
    from aiayn.config import Config, DecodeConfig
    from aiayn.data.tokenizer import Tokenizer

    rng = random.Random(seed)
    letters = "abcdefghij"
    sentences = [
        " ".join("".join(rng.choice(letters) for _ in range(rng.randint(1, 4))) for _ in range(6))
        for _ in range(300)
    ]
    tok = Tokenizer.train_from_sentences(sentences, 60, None)
    settings = dict(N=2, d_model=32, h=2, d_k=16, d_v=16, d_ff=64, P_drop=0.0)
    cfg = ModelConfig(**{**settings, **model, "vocab_size": tok.vocab_size})
    torch.manual_seed(seed)
    net = Transformer(cfg)
    config = Config(model=cfg, decode=DecodeConfig(beam=4, alpha=0.6, max_len_a=0.0, max_len_b=8))
    save_checkpoint_file(
        path,
        {
            "format": FORMAT,
            "config": config.to_dict(),
            "vocab_sha256": tok.sha256,
            "tokenizer": torch.frombuffer(bytearray(tok.to_bytes()), dtype=torch.uint8),
            "model": net.state_dict(),
            "step": 0,
        },
    )
    return path
