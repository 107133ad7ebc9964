"""Translate text: subword-encode, batch by source tokens, beam search, restore order (6.1).

Promises (RELIABILITY.md, group F):

- F1: no input lines give no output lines (and `translate_file` logs a warning).
- F2: an empty or whitespace-only line gives an empty output line and is not fed to the
  model.
- F3: one output per input line, in input order, although batches are sorted by length.
- F4: an input longer than `max_input_len` subwords (or than the model's position table)
  is truncated, with a warning naming its line number.
- F6/F7: outputs do not depend on batch size or on the run (search is batch-invariant).
- F8: characters the vocabulary never saw (emoji, other scripts) become <unk> (id 1) in
  the source, as sentencepiece encodes them (its NFKC normalisation drops control
  characters before that); the model translates the rest of the line; <unk> tokens and
  the lines holding them are counted in the summary. The output never contains "<unk>"
  text: decoding renders it as " ⁇ ".
- F9: invalid UTF-8 is replaced by U+FFFD, counted and reported as a partial result.
- F13: the output file is written atomically (temporary file, fsync, rename).

The source fed to the model is the line's subword ids followed by EOS.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from aiayn import native
from aiayn.batching import decode_batches
from aiayn.config import EOS_ID, PAD_ID, UNK_ID, DecodeConfig
from aiayn.ensemble import Ensemble
from aiayn.files import atomic_write, open_bytes
from aiayn.flops import slow_bf16_warning
from aiayn.model import Transformer, onednn_bf16
from aiayn.search import Hypothesis, beam_search, position_limit
from aiayn.workers import check_workers, map_batches

logger = logging.getLogger(__name__)

#: Individual warnings for truncated lines; later ones are only counted.
MAX_LINE_WARNINGS = 10

#: What translates: one model, or several as an ensemble (`aiayn.ensemble`).
Decoder = Transformer | Ensemble


class SubwordTokenizer(Protocol):
    """Text <-> subword ids (aiayn.tokenizer.Tokenizer); `decode` removes the subword marks."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Translation:
    """One output of one input line: detokenised text and its length-normalised score."""

    text: str
    score: float


@dataclass
class TranslateStats:
    """Counts for the exit summary."""

    lines: int = 0
    empty: int = 0
    truncated: int = 0
    unk_tokens: int = 0  # source subwords that are <unk> (F8)
    unk_lines: int = 0


INFERENCE_DTYPES = ("fp32", "bf16", "int8")


class PackedLinear(nn.Module):
    """A bf16 `nn.Linear` for CPU inference whose weight oneDNN has reordered once.

    `F.linear` on bf16 CPU tensors runs oneDNN's AMX matmul on the plain (out, in) weight,
    which it repacks into AMX's blocked layout on every call; in a beam search the same
    weights are used ~20 times per batch. Packed once, the products of a decoding step
    (rows 64-1,024, d_model 512) ran 1.1-1.5x faster, with the same results but for an
    occasional last-bit difference in some shapes (the reduction is blocked differently;
    docs/performance.md). Inference only: there is no gradient, and changing `weight`
    afterwards does not change the packed copy. `weight` and `bias` stay parameters, so
    state_dict keys and tied embeddings are unchanged.
    """

    #: rows the packed layout is tuned for (beam 4 x 64 sentences); any row count works
    ROWS_HINT = 256

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._pack()

    def _pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                               self.ROWS_HINT)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    # oneDNN's opaque tensors cannot be copied or pickled: drop the packed copy, repack
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_packed", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pack()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=onednn")


#: int32 products per block of `Int8Linear.lse_topk` (a block of columns for all the rows):
#: about a core's L2 cache (for 256 rows x 10,000 columns on an AMD EPYC VM, 256 KiB-4 MiB
#: measured, 1-2 MiB fastest: docs/performance.md).
LSE_TOPK_BLOCK_BYTES = 1024 * 1024


class Int8Linear(nn.Module):
    """An `nn.Linear` for CPU inference with int8 weights and int8 activations (dynamic
    quantization): y ~ s_x s_w (q_x q_W^T) + b.

    The weight is quantized once, symmetrically, with one scale per output column
    (s_w = max|W_j| / 127); each input row gets its own scale at run time (s_x =
    max|x_i| / 127). The integer product is `torch._int_mm` (int8 x int8 -> int32, exact;
    oneDNN's s8 GEMM in PyTorch's CPU build), the passes before and after it are
    `native.quantize_rows` / `native.dequantize_rows` (PyTorch ops without the compiled
    library). This replaces `torch.ao.quantization.quantize_dynamic`, which PyTorch has
    deprecated (it printed a warning on every run) and whose activations share one scale
    per call. float32 in and out; no gradient.
    """

    weight_int8: Tensor  # (out, in) int8
    weight_scale: Tensor  # (out,) float32
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_int8, weight_scale = quantize_per_row(linear.weight.detach().float())
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(x, relu=False)

    def forward_relu(self, x: Tensor) -> Tensor:
        """max(0, forward(x)), the ReLU applied in the dequantizing pass (the FFN's first
        layer, `model.PositionwiseFeedForward`): the same values as torch.relu after it."""
        return self._forward(x, relu=True)

    def _quantized(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of x (..., in_features) quantized: (rows, in) int8 and each row's
        scale."""
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or x2.dtype != torch.float32:
            x2 = x2.float().contiguous()
        return native.quantize_rows(x2) or quantize_per_row(x2)

    def _products(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of x (..., in_features) quantized and multiplied: the (rows, out)
        int32 products and each row's scale."""
        x_int8, x_scale = self._quantized(x)
        return int8_matmul(x_int8, self.weight_int8), x_scale

    def _forward(self, x: Tensor, relu: bool) -> Tensor:
        lead = x.shape[:-1]
        acc, x_scale = self._products(x)
        y = native.dequantize_rows(acc, x_scale, self.weight_scale, self.bias, relu)
        if y is None:
            y = acc.float().mul_(x_scale[:, None]).mul_(self.weight_scale)
            if self.bias is not None:
                y.add_(self.bias)
            if relu:
                y.relu_()
        return y.view(*lead, self.out_features)

    def lse_topk(self, x: Tensor, k: int, exclude: tuple[int, ...]
                 ) -> tuple[Tensor, Tensor] | None:
        """As the output layer of a beam search: `native.lse_topk` of this layer's outputs
        for the rows x (R, in_features), the logits scaled from the int32 products as they
        are read, without writing them out (`native.lse_topk_int8_blocked`). The products
        are made `LSE_TOPK_BLOCK_BYTES` of int32 at a time (a block of the vocabulary's
        columns for all the rows) and consumed while in cache, instead of a (R, V) table
        written to memory and read back. The k logits and columns are those of the
        layer's float outputs; the normaliser may differ in its last bits (the sum of
        exponentials runs block by block). None where that does not apply (no compiled
        library): the caller then calls the layer."""
        if native.library() is None or x.dim() != 2:
            return None
        x_int8, x_scale = self._quantized(x)
        rows, v = x_int8.size(0), self.out_features
        block = min(v, max(64, LSE_TOPK_BLOCK_BYTES // (4 * max(rows, 1)) // 64 * 64))
        w = self.weight_int8
        # one buffer for every block: each is consumed before the next is made, and its
        # pages stay in cache
        flat = torch.empty(rows * block, dtype=torch.int32)

        def products(c0: int, c1: int) -> Tensor:
            return int8_matmul(x_int8, w[c0:c1], out=flat[:rows * (c1 - c0)].view(rows, -1))

        return native.lse_topk_int8_blocked(products, rows, v, x_scale, self.weight_scale,
                                            self.bias, k, exclude, block)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8")


def quantize_per_row(t: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of a 2-D float32 tensor, with PyTorch ops: (int8 q, float32
    scale), q = round(t * 127 / max|t|) (ties to even), scale = max|t| / 127; an all-zero
    row gives zeros and scale 0. `native.quantize_rows` computes the same in C."""
    amax = t.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(t * inv[:, None]).to(torch.int8), amax / 127.0


def int8_matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b.T for int8 (M, K) and (N, K): (M, N) int32, exact, into `out` (contiguous)
    if given. `torch._int_mm` where this build has it for the CPU; else float32 products
    of the integers (exact while K * 127 * 127 < 2^24, i.e. K <= 1,040, and within float32
    rounding beyond)."""
    if _has_int_mm():
        return torch._int_mm(a, b.t()) if out is None else torch._int_mm(a, b.t(), out=out)
    y = torch.round(a.float() @ b.float().t()).to(torch.int32)
    return y if out is None else out.copy_(y)


@functools.cache
def _has_int_mm() -> bool:
    try:
        a = torch.tensor([[1, -2, 3]], dtype=torch.int8)
        b = torch.tensor([[4, 5, -6], [127, -128, 1]], dtype=torch.int8)
        return bool(torch.equal(torch._int_mm(a, b.t()),
                                torch.tensor([[-24, 386]], dtype=torch.int32)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace every CPU `nn.Linear` of `model` by an `Int8Linear`, in place (a tied
    embedding keeps its float weight; the output projection gets an int8 copy)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                setattr(module, name, Int8Linear(child))
    return model


@functools.cache
def can_pack_bf16() -> bool:
    """Whether this PyTorch build and CPU run oneDNN's packed bf16 linear (x86 CPUs with
    AVX-512 or AMX): the ops must exist and give nn.Linear's result on a small product."""
    if not onednn_bf16():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=gen).to(torch.bfloat16)
        x = torch.randn(5, 16, generator=gen).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 5)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(out.float(), (x.float() @ w.float().t()), rtol=1e-2,
                                   atol=1e-2))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every bf16 CPU `nn.Linear` of `model` by a `PackedLinear`, in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
                    and child.weight.device.type == "cpu"):
                setattr(module, name, PackedLinear(child))
    return model


def cast_for_inference(model: Transformer, dtype: str) -> Transformer:
    """The model in an inference precision: "fp32" as trained, "bf16" (weights and
    activations; AMX on recent Intel CPUs, with the weights packed for oneDNN once), or
    "int8" (dynamic quantization of every Linear, `Int8Linear`: int8 weights per output
    column, activations quantized per row at run time; CPU only). Parameters stop
    requiring gradients: this is for decoding only."""
    if dtype not in INFERENCE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(INFERENCE_DTYPES)}, got {dtype!r}")
    model.requires_grad_(False)
    if dtype == "bf16":
        warning = slow_bf16_warning(next(model.parameters()).device)
        if warning:
            logger.warning(warning)
        model = model.to(torch.bfloat16)
        if can_pack_bf16():
            pack_linears(model)
        return model
    if dtype == "int8":
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ValueError(f"dtype int8 (dynamic quantization) runs on the CPU only, not on "
                             f"{device}: use bf16 there")
        quantize_linears(model)
    return model


# ------------------------------------------------------------------------- preparing
def encode_sources(tokenizer: SubwordTokenizer, lines: Sequence[str], max_input_len: int,
                   stats: TranslateStats) -> list[list[int] | None]:
    """Subword ids + [EOS] per line; None for a blank line (it is not translated).

    Lines longer than `max_input_len` subwords are cut to that length, with a warning
    naming the (1-based) line number.
    """
    sources: list[list[int] | None] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            stats.empty += 1
            sources.append(None)
            continue
        ids = tokenizer.encode(line)
        unk = sum(1 for i in ids if i == UNK_ID)
        stats.unk_tokens += unk
        stats.unk_lines += unk > 0
        if len(ids) > max_input_len:
            stats.truncated += 1
            if stats.truncated <= MAX_LINE_WARNINGS:
                logger.warning("line %d: %d subwords, truncated to max_input_len=%d",
                               lineno, len(ids), max_input_len)
            ids = ids[:max_input_len]
        sources.append([*ids, EOS_ID])
    if stats.truncated > MAX_LINE_WARNINGS:
        logger.warning("%d lines truncated to max_input_len=%d in all", stats.truncated,
                       max_input_len)
    return sources


def pad_batch(sequences: Sequence[list[int]], device: str | torch.device) -> Tensor:
    """Right-pad id lists with PAD into (B, S)."""
    longest = max(len(s) for s in sequences)
    src = torch.full((len(sequences), longest), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(sequences):
        src[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    return src.to(device)


# ------------------------------------------------------------------------- translating
def _input_limit(model: Decoder, cfg: DecodeConfig) -> int:
    """Longest source in subwords: max_input_len, and room for EOS in the position table."""
    limit = position_limit(model)
    return cfg.max_input_len if limit is None else min(cfg.max_input_len, limit - 1)


def _to_translations(tokenizer: SubwordTokenizer, hyps: list[Hypothesis]) -> list[Translation]:
    # one output line per input line: a newline inside a decoded string would break that
    return [Translation(tokenizer.decode(h.tokens).replace("\n", " ").replace("\r", " "),
                        h.score) for h in hyps]


def translate_nbest(model: Decoder, tokenizer: SubwordTokenizer, lines: Sequence[str],
                    cfg: DecodeConfig, device: str | torch.device = "cpu",
                    progress: Callable[[int], None] | None = None, workers: int = 1,
                    ) -> tuple[list[list[Translation]], TranslateStats]:
    """Translate lines with beam search; each line gets its `cfg.nbest` best outputs.

    Args:
        model: a `Transformer` on `device`, or an `Ensemble` of them; put in eval mode.
        lines: input sentences; blank ones give [] and are not fed to the model.
        cfg: beam, alpha, length cap, nbest, batch size (max_tokens), max_input_len.
        progress: called with the number of lines finished after each batch.
        workers: CPU only: decode the batches in this many forked processes of one
            thread each (`aiayn.workers`), instead of one process with all threads.
    Returns:
        One list of Translation per input line, in input order, best first; and counts.
    Raises:
        ConfigError (a ValueError) naming an invalid option, before any work.
    """
    cfg.validate()
    check_workers(workers, device)
    stats = TranslateStats(lines=len(lines))
    sources = encode_sources(tokenizer, lines, _input_limit(model, cfg), stats)
    results: list[list[Translation]] = [[] for _ in lines]
    kept = [i for i, s in enumerate(sources) if s is not None]  # blank lines skip the model
    if progress is not None and stats.empty:
        progress(stats.empty)
    model.eval()
    # decode_batches counts the EOS itself: pass the lengths without it.
    batches = [[kept[r] for r in rows] for rows in decode_batches(
        [len(sources[i]) - 1 for i in kept], cfg.max_tokens)]  # type: ignore[arg-type]

    def decode(b: int) -> list[list[Hypothesis]]:
        src = pad_batch([sources[i] for i in batches[b]], device)  # type: ignore[misc]
        return beam_search(model, src, cfg.beam, cfg.alpha, cfg.max_len_a, cfg.max_len_b,
                           cfg.nbest)

    def done(b: int, hyps: list[list[Hypothesis]]) -> None:
        for i, sentence_hyps in zip(batches[b], hyps, strict=True):
            results[i] = _to_translations(tokenizer, sentence_hyps)
        if progress is not None:
            progress(len(batches[b]))

    map_batches(decode, len(batches), workers, done)
    return results, stats


def translate_lines(model: Decoder, tokenizer: SubwordTokenizer, lines: Sequence[str],
                    cfg: DecodeConfig, device: str | torch.device = "cpu",
                    progress: Callable[[int], None] | None = None,
                    workers: int = 1) -> list[str]:
    """The best translation of each line, in input order; "" for a blank line (F1-F3).

    See `translate_nbest` for the arguments.
    """
    nbest, _ = translate_nbest(model, tokenizer, lines, cfg, device, progress, workers)
    return [outputs[0].text if outputs else "" for outputs in nbest]


# ------------------------------------------------------------------------- files
def decode_lines(data: bytes, name: str) -> tuple[list[str], list[int]]:
    """Split bytes into lines on b"\\n" only (like files.read_lines) and decode them.

    Invalid UTF-8 is replaced by U+FFFD, with a warning naming the line (F9).
    Returns:
        The lines, and the 1-based numbers of the lines that had invalid UTF-8.
    """
    raw_lines = data.split(b"\n") if data else []
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()  # the final newline ends the last line, it does not start another
    if raw_lines and raw_lines[0].startswith(b"\xef\xbb\xbf"):
        raw_lines[0] = raw_lines[0][3:]  # a UTF-8 byte-order mark is not text
    lines, bad = [], []
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad.append(lineno)
            if len(bad) <= MAX_LINE_WARNINGS:
                logger.warning("%s:%d: invalid UTF-8 at byte %d, replaced by U+FFFD", name,
                               lineno, e.start)
            lines.append(raw.decode("utf-8", errors="replace"))
    return lines, bad


def read_input(path: str | Path | None) -> tuple[list[str], list[int]]:
    """Lines of a text file (plain or gzip), or of stdin when `path` is None; see decode_lines."""
    if path is None:
        return decode_lines(sys.stdin.buffer.read(), "<stdin>")
    with open_bytes(path) as f:
        return decode_lines(f.read(), str(path))


def format_output(i: int, outputs: list[Translation], nbest: int) -> str:
    """Output lines of input line i (0-based).

    nbest == 1: the best translation. nbest > 1: Moses-style "i ||| text ||| score" lines
    (score: length-normalised log-probability), so that the file can be realigned; a
    blank input gives one line with empty text and score 0.
    """
    if nbest == 1:
        return (outputs[0].text if outputs else "") + "\n"
    outputs = outputs or [Translation("", 0.0)]
    return "".join(f"{i} ||| {t.text} ||| {t.score:.6f}\n" for t in outputs)


def translate_file(model: Decoder, tokenizer: SubwordTokenizer, input_path: str | Path | None,
                   output_path: str | Path | None, cfg: DecodeConfig,
                   device: str | torch.device = "cpu",
                   progress: Callable[[int], None] | None = None,
                   workers: int = 1) -> dict[str, Any]:
    """Translate a file (or stdin) into a file (atomically, F13) or stdout.

    Returns:
        Summary: lines, empty, truncated, unk_tokens and unk_lines (source subwords
        that are <unk>, F8), bad_utf8 (line count), partial (True when some
        input had to be repaired: the CLI exits non-zero, F9), seconds, sentences_per_s.
    """
    cfg.validate()
    start = time.perf_counter()
    lines, bad = read_input(input_path)
    if not lines:
        logger.warning("%s: empty input, writing no output lines",
                       input_path if input_path is not None else "<stdin>")
    nbest, stats = translate_nbest(model, tokenizer, lines, cfg, device, progress, workers)
    text = "".join(format_output(i, outputs, cfg.nbest) for i, outputs in enumerate(nbest))
    if output_path is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with atomic_write(output_path, "w") as f:
            f.write(text)
    seconds = time.perf_counter() - start
    if stats.unk_tokens:
        logger.info("%d source subwords in %d lines are <unk> (unseen characters)",
                    stats.unk_tokens, stats.unk_lines)
    return {"lines": stats.lines, "empty": stats.empty, "truncated": stats.truncated,
            "unk_tokens": stats.unk_tokens, "unk_lines": stats.unk_lines,
            "bad_utf8": len(bad), "partial": bool(bad), "seconds": seconds,
            "sentences_per_s": (stats.lines - stats.empty) / seconds if seconds > 0 else 0.0}
