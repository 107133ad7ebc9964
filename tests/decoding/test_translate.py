"""Tests for aiayn.decoding.translate: line-level promises of the translation command
(RELIABILITY F)."""

from __future__ import annotations

import copy
import io
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from aiayn.config import EOS_ID, DecodeConfig, ModelConfig
from aiayn.data.batching import decode_batches
from aiayn.decoding.translate import (
    decode_lines,
    translate_file,
    translate_lines,
    translate_nbest,
)
from aiayn.fast.inference import Int8Linear, can_pack_bf16
from aiayn.fast.machine import cast_for_inference
from aiayn.model import Transformer
from helpers import fast_transformer

CFG = DecodeConfig(beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5)


pytestmark = pytest.mark.usefixtures("one_thread")


class WordTokenizer:
    """Fake subword tokenizer: word "w<n>" <-> id n (4 <= n < 40); anything else is UNK."""

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            n = int(word[1:]) if word[:1] == "w" and word[1:].isdigit() else 1
            ids.append(n if 4 <= n < 40 else 1)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" if i >= 4 else "<unk>" for i in ids)


class EosRamp(Transformer):
    """A random tiny Transformer nudged towards EOS as the output grows (varied lengths);
    it counts the sentences it encodes, to check which lines reach the model."""

    encoded = 0

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        self.encoded += src.size(0)
        return super().encode(src)

    def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list) -> Tensor:
        t = states[0].self_cache.length
        logits = super().decode_step(tokens, src_mask, states)
        logits[:, EOS_ID] += 0.5 * t - 3.0
        return logits


@pytest.fixture
def model() -> EosRamp:
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


TOK = WordTokenizer()


def sentences(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (n,), generator=g).tolist()
    return [
        " ".join(f"w{i}" for i in torch.randint(4, 40, (k,), generator=g).tolist()) for k in lengths
    ]


# ------------------------------------------------------------------------- lines
@pytest.mark.rows("F1")
def test_empty_input_gives_empty_output(model: EosRamp) -> None:
    """RELIABILITY F1: no input lines -> [] (CTranslate2's choice), the model unused."""
    assert translate_lines(model, TOK, [], CFG) == []
    assert model.encoded == 0


@pytest.mark.rows("F2")
def test_blank_lines_keep_their_positions_and_skip_the_model(model: EosRamp) -> None:
    """RELIABILITY F2: empty and whitespace-only lines give "" at their positions and are
    not fed to the model; the other lines translate as they would alone."""
    lines = ["w5 w6 w7", "", "   ", "w9 w10\t", "\t", "w33"]
    out = translate_lines(model, TOK, lines, CFG)
    assert model.encoded == 3
    assert [out[i] for i in (1, 2, 4)] == ["", "", ""]
    assert [out[i] for i in (0, 3, 5)] == translate_lines(
        model, TOK, [lines[i] for i in (0, 3, 5)], CFG
    )
    assert all(out[i] for i in (0, 3, 5))


@pytest.mark.rows("F3")
def test_count_and_order_preserved_with_sorted_batching(model: EosRamp) -> None:
    """RELIABILITY F3: one output per input, in input order, although batches are sorted
    by length (each line's output equals its output when translated alone)."""
    lines = sentences(12)
    out = translate_lines(model, TOK, lines, replace(CFG, max_tokens=30))
    assert len(out) == len(lines)
    assert out == [translate_lines(model, TOK, [line], CFG)[0] for line in lines]
    assert len(set(out)) > len(out) // 2  # outputs differ, so a permutation would show


@pytest.mark.rows("F4")
def test_long_line_truncated_with_warning_naming_it(
    model: EosRamp, caplog: pytest.LogCaptureFixture
) -> None:
    """RELIABILITY F4: a line over max_input_len subwords is truncated, with a warning
    naming its line number; the other lines are unaffected."""
    long_line = " ".join(f"w{4 + i % 30}" for i in range(200))
    lines = ["w5 w6", "w7 w8 w9", long_line, "w10"]
    cfg = replace(CFG, max_input_len=6)
    with caplog.at_level(logging.WARNING, logger="aiayn.decoding.translate"):
        nbest, stats = translate_nbest(model, TOK, lines, cfg)
    assert stats.truncated == 1
    assert "line 3" in caplog.text and "200 subwords" in caplog.text
    out = [n[0].text for n in nbest]
    truncated = " ".join(long_line.split()[:6])
    assert out == translate_lines(model, TOK, [lines[0], lines[1], truncated, lines[3]], CFG)


@pytest.mark.rows("F6")
def test_batch_size_does_not_change_outputs(model: EosRamp) -> None:
    """RELIABILITY F6 (CPU fp32): batches of 1 sentence, a few, and all give identical
    output strings."""
    lines = sentences(20, seed=3)
    outputs = [
        translate_lines(model, TOK, lines, replace(CFG, max_tokens=m)) for m in (1, 7, 40, 100_000)
    ]
    assert all(o == outputs[0] for o in outputs[1:])


def test_worker_processes_give_the_same_outputs_in_order(model: EosRamp) -> None:
    """Batches decoded by forked one-thread workers (aiayn.decoding.workers) give the same n-best
    lists and scores, in input order, as one process; progress counts every line, blank
    ones included."""
    lines = sentences(30, seed=5)
    lines[4] = ""
    cfg = replace(CFG, max_tokens=12, nbest=2)  # many small batches
    seen: list[int] = []
    ref, ref_stats = translate_nbest(model, TOK, lines, cfg)
    got, stats = translate_nbest(model, TOK, lines, cfg, progress=seen.append, workers=2)
    assert got == ref and stats == ref_stats
    assert sum(seen) == len(lines)
    with pytest.raises(ValueError, match="workers"):
        translate_nbest(model, TOK, lines, cfg, workers=0)


def test_batches_respect_the_token_budget() -> None:
    """Section 5.1-style batching by source tokens (EOS included): size x longest <=
    max_tokens (a longer line alone), longest first, every line exactly once."""
    lengths = [3, 9, 4, 9, 1, 20]  # subwords; + EOS inside the budget
    batches = decode_batches(lengths, max_tokens=20)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert batches[0] == [5]  # 21 > 20: alone
    for b in batches:
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + 1) <= 20
    assert batches[1] == [1, 3]  # equal lengths keep input order


@pytest.mark.rows("F7")
def test_run_twice_identical(model: EosRamp, tmp_path: Path) -> None:
    """RELIABILITY F7: the same input translated twice gives byte-identical output."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(sentences(10)) + "\n", encoding="utf-8")
    translate_file(model, TOK, src, tmp_path / "a.txt", CFG)
    translate_file(model, TOK, src, tmp_path / "b.txt", CFG)
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()


@pytest.mark.rows("F14")
@pytest.mark.parametrize(
    ("change", "option"),
    [
        ({"beam": 0}, "beam"),
        ({"alpha": -0.6}, "alpha"),
        ({"beam": 2, "nbest": 3}, "nbest"),
    ],
)
def test_invalid_options_raise_naming_the_option(model: EosRamp, change: dict, option: str) -> None:
    """RELIABILITY F14: beam 0, negative length penalty, nbest > beam: ValueError naming
    the option, before any work."""
    with pytest.raises(ValueError, match=option):
        translate_lines(model, TOK, ["w5 w6"], replace(CFG, **change))
    assert model.encoded == 0


def test_nbest_lists_are_sorted_and_distinct(model: EosRamp) -> None:
    """Section 6.1 beam search: nbest outputs per line, best score first."""
    nbest, _ = translate_nbest(model, TOK, ["w5 w6 w7", ""], replace(CFG, nbest=3))
    assert len(nbest[0]) == 3 and nbest[1] == []
    scores = [t.score for t in nbest[0]]
    assert scores == sorted(scores, reverse=True)


# ------------------------------------------------------------------------- files
@pytest.mark.rows("F2", "F3", "F13")
def test_translate_file_summary_and_line_count(model: EosRamp, tmp_path: Path) -> None:
    """RELIABILITY F2/F3/F13: the output file has one line per input line, blank lines
    blank, no temporary file left; the summary counts lines, blanks and truncations."""
    lines = ["w5 w6", "", "w7 w8 w9 w10 w11 w12 w13 w14", "w9"]
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = translate_file(model, TOK, src, out, replace(CFG, max_input_len=4))
    written = out.read_text(encoding="utf-8").split("\n")
    assert written[-1] == "" and len(written) - 1 == len(lines)
    assert written[1] == ""
    assert written[:-1] == translate_lines(model, TOK, lines, replace(CFG, max_input_len=4))
    assert summary["lines"] == 4 and summary["empty"] == 1 and summary["truncated"] == 1
    assert summary["bad_utf8"] == 0 and summary["partial"] is False
    assert summary["seconds"] > 0 and summary["sentences_per_s"] > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.rows("F1")
def test_empty_file_gives_empty_output_and_warning(
    model: EosRamp, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RELIABILITY F1: an empty input file gives an empty output file and a warning."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="aiayn.decoding.translate"):
        summary = translate_file(model, TOK, src, out, CFG)
    assert out.read_bytes() == b""
    assert summary["lines"] == 0
    assert "empty input" in caplog.text


@pytest.mark.rows("F9")
def test_bad_utf8_replaced_counted_and_partial(
    model: EosRamp, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RELIABILITY F9: an invalid UTF-8 line is replaced (U+FFFD), warned about with its
    line number, counted; the line count is preserved and the result marked partial."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_bytes(b"w5 w6\nw7 \xe9 w8\nw9\n")
    with caplog.at_level(logging.WARNING, logger="aiayn.decoding.translate"):
        summary = translate_file(model, TOK, src, out, CFG)
    assert summary["bad_utf8"] == 1 and summary["partial"] is True
    assert "in.txt:2" in caplog.text
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3


@pytest.mark.rows("E4", "F3")
def test_lines_split_on_newline_only() -> None:
    """RELIABILITY E4/F3: lines split on b"\\n" only, so a stray \\r or U+2028 stays inside
    its line and the count agrees with `wc -l`; a BOM is dropped."""
    lines, bad = decode_lines("\ufeffa\rb\nc\u2028d\ne".encode(), "x")
    assert lines == ["a\rb", "c\u2028d", "e"] and bad == []


@pytest.mark.rows("F13")
def test_failed_translation_leaves_existing_output_untouched(
    model: EosRamp, tmp_path: Path
) -> None:
    """RELIABILITY F13: a crash while translating never leaves a half-written output."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("w5 w6\nw7\n", encoding="utf-8")
    out.write_text("previous\n", encoding="utf-8")

    class Broken(EosRamp):
        def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list) -> Tensor:
            raise RuntimeError("boom")

    broken = Broken(model.cfg).eval()
    with pytest.raises(RuntimeError, match="boom"):
        translate_file(broken, TOK, src, out, CFG)
    assert out.read_text(encoding="utf-8") == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def test_stdin_to_stdout_with_nbest_format(
    model: EosRamp, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Section 6.1 n-best output: "i ||| text ||| score" lines (Moses style, 0-based i),
    nbest per translated line and one for a blank line; read from stdin, written to stdout."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w5 w6\n\nw7\n")))
    summary = translate_file(model, TOK, None, None, replace(CFG, nbest=2))
    rows = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "1", "2", "2"]
    assert rows[2] == ["1", "", "0.000000"]
    best = translate_lines(model, TOK, ["w5 w6", "", "w7"], CFG)
    assert [rows[0][1], rows[3][1]] == [best[0], best[2]]
    assert float(rows[0][2]) >= float(rows[1][2])
    assert summary["lines"] == 3


@pytest.mark.rows("F8")
def test_unseen_characters_become_unk_and_are_counted(small_data: Path, tmp_path: Path) -> None:
    """RELIABILITY F8: emoji, CJK and a control character with a real sentencepiece
    vocabulary: no crash, one output line each, and the summary's <unk> counts equal
    those of the tokenizer's own encoding (control characters are normalised away)."""
    from aiayn.data.tokenizer import Tokenizer

    tok = Tokenizer.load(small_data / "spm.model")
    torch.manual_seed(0)
    m = fast_transformer(
        ModelConfig(
            N=1, d_model=32, h=2, d_k=16, d_v=16, d_ff=64, P_drop=0.0, vocab_size=tok.vocab_size
        )
    ).eval()
    lines = [
        "A man is walking .",
        "\U0001f600 \U0001f436 ein Hund",
        "\u65e5\u672c\u8a9e",
        "bell \x07 here",
        "A dog .",
    ]
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    summary = translate_file(m, tok, src, out, replace(CFG, max_len_b=3))
    assert len(out.read_text(encoding="utf-8").split("\n")) == len(lines) + 1
    unk = [tok.encode(x).count(1) for x in lines]
    assert unk[1] == 2 and unk[2] >= 1 and unk[0] == unk[3] == unk[4] == 0
    assert summary["unk_tokens"] == sum(unk) and summary["unk_lines"] == 2


def test_inference_precisions_translate_every_line(model: EosRamp) -> None:
    """Decoding in bf16 or int8 (dynamic quantization) keeps the line-for-line contract, and
    int8 quantizes every Linear; an unknown precision is refused by name."""
    from aiayn.fast.machine import cast_for_inference

    lines = sentences(12)
    ref = translate_lines(model, TOK, lines, CFG)
    for dtype in ("bf16", "int8"):
        m = cast_for_inference(copy.deepcopy(model), dtype)
        out = translate_lines(m, TOK, lines, CFG)
        assert len(out) == len(ref) and [x == "" for x in out] == [x == "" for x in ref]
        if dtype == "int8":
            assert not any(type(x) is torch.nn.Linear for x in m.modules())
            assert isinstance(m.generator, Int8Linear)
        else:
            assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    with pytest.raises(ValueError, match="fp16"):
        cast_for_inference(model, "fp16")


@pytest.mark.skipif(not can_pack_bf16(), reason="no oneDNN bf16 linear in this build")
def test_packed_bf16_linears_match_plain_bf16_and_keep_the_model_intact() -> None:
    """bf16 inference packs every Linear for oneDNN once (PackedLinear): its products must
    equal nn.Linear's in bf16 (same fp32 accumulation; the reduction order may differ by
    one bf16 rounding), for 2-D, 3-D and empty inputs, with and without bias; the
    state_dict keys, the tied embedding and copy/pickle must survive the packing."""
    import pickle

    from aiayn.fast.inference import PackedLinear
    from aiayn.fast.machine import cast_for_inference

    torch.manual_seed(0)
    for bias in (True, False):
        lin = torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16).requires_grad_(False)
        packed = PackedLinear(lin)
        for shape in ((5, 96), (3, 7, 96), (0, 96), (300, 96)):
            x = torch.randn(*shape).to(torch.bfloat16)
            ref, out = lin(x), packed(x)
            assert out.shape == ref.shape and out.dtype == torch.bfloat16
            # at most two bf16 rounding steps (2^-8 relative each) of the largest output
            scale = ref.float().abs().amax().item() if ref.numel() else 0.0
            torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=scale * 2**-7 + 1e-6)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, vocab_size=50)
    model = fast_transformer(cfg).eval()
    keys = list(model.state_dict())
    m = cast_for_inference(copy.deepcopy(model), "bf16")
    assert not any(type(x) is torch.nn.Linear for x in m.modules())
    assert list(m.state_dict()) == keys
    assert isinstance(m.generator, PackedLinear)
    assert m.generator.weight is m.tgt_embed.token.weight  # still tied
    src = torch.randint(4, 50, (3, 6))
    with torch.inference_mode():
        ref = fast_transformer(cfg).eval()
        ref.load_state_dict(model.state_dict())
        ref = ref.to(torch.bfloat16)
        want = ref(src, src)
        got = m(src, src)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
        for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            assert torch.equal(clone(src, src), got)


def _quantized(t: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row, from the definition, in float64: (integers, scales)."""
    amax = t.double().abs().amax(dim=1, keepdim=True)
    q = torch.where(amax > 0, torch.round(t.double() * (127 / amax)), 0.0)
    return q, amax / 127


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_the_product_of_the_quantized_operands(bias: bool, monkeypatch) -> None:
    """Int8Linear computes (s_x q_x)(s_w q_w)^T + b: the same integers as quantizing by the
    definition, the product exact, float32 rounding after it; and it stays within the analytic
    bound of the quantization error from the float32 Linear:
    |y - y_int8| <= sum_k |x_k| s_w / 2 + |w~_k| s_x / 2 (each operand off by half a
    step). The same with PyTorch ops (no compiled library), with each backend of the
    integer product (`int8_ops.backend`: torch._int_mm where it is exact, aiayn's kernel,
    float32 products of the integers)."""
    import aiayn.fast.int8_ops as tr
    from aiayn.fast import native

    torch.manual_seed(1)
    lin = torch.nn.Linear(200, 72, bias=bias).requires_grad_(False)
    lin.weight[5].zero_()  # an all-zero output column
    layer = Int8Linear(lin)
    qw, sw = _quantized(lin.weight)
    assert torch.equal(layer.weight_int8, qw.to(torch.int8))
    x = torch.randn(4, 9, 200) * torch.rand(4, 9, 1) * 3
    x[1, 2] = 0.0  # an all-zero input row
    exact_int_mm = tr._int_mm_exact()
    cases: dict[str, list[tuple[object, str, object]]] = {
        "native": [],
        # no compiled library: PyTorch ops around torch._int_mm where it is exact here
        "torch ops": [
            (native, "library", lambda: None),
            (tr, "backend", lambda: "torch" if exact_int_mm else "float"),
        ],
        "float products": [(tr, "backend", lambda: "float")],
    }
    if native.library() is not None:
        cases["aiayn kernel"] = [(tr, "backend", lambda: "aiayn")]
    outs = {}
    for name, patches in cases.items():
        for patch in patches:
            monkeypatch.setattr(*patch)
        layer._weight = tr.Int8Weight(layer.weight_int8)  # as a layer made under them
        outs[name] = layer(x)
        monkeypatch.undo()
    layer._weight = tr.Int8Weight(layer.weight_int8)
    x2 = x.reshape(-1, 200)
    qx, sx = _quantized(x2)
    exact = (qx @ qw.t()) * sx * sw.t() + (lin.bias.double() if bias else 0.0)
    ref = lin(x2).double()
    bound = (
        x2.double().abs().sum(1, keepdim=True) * sw.t() / 2
        + sx / 2 * (qw * sw).abs().sum(1)[None, :]
    )
    for name, y in outs.items():
        assert y.shape == (4, 9, 72) and y.dtype == torch.float32, name
        y2 = y.reshape(-1, 72).double()
        torch.testing.assert_close(y2, exact, rtol=1e-6, atol=1e-6, msg=name)
        assert ((y2 - ref).abs() <= bound + 1e-5).all(), name
        assert (y2[:, 5] == (lin.bias[5] if bias else 0.0)).all(), name
    assert torch.equal(outs["native"][1, 2], lin.bias if bias else torch.zeros(72))
    # a row's result does not depend on the other rows (its own scale, exact integers)
    rows = x.reshape(-1, 200)
    assert torch.equal(torch.cat([layer(rows[:5]), layer(rows[5:])]), layer(rows))
    assert layer(torch.randn(0, 200)).shape == (0, 72)
    strided = x.transpose(0, 1)  # not contiguous: reshaped into a copy
    torch.testing.assert_close(layer(strided), outs["native"].transpose(0, 1))
    # the FFN's first layer: ReLU in the dequantizing pass, the values of torch.relu after
    # the layer, with the compiled library and without
    for name, patches in cases.items():
        for patch in patches:
            monkeypatch.setattr(*patch)
        layer._weight = tr.Int8Weight(layer.weight_int8)
        fused = layer.forward_relu(x)
        monkeypatch.undo()
        assert torch.equal(fused, torch.relu(outs[name])), name
        assert (fused == 0).any() and (fused > 0).any(), name


def test_int8_linear_with_7_bit_activations_is_the_product_of_those(monkeypatch) -> None:
    """`act_bits = 7` (AIAYN_INT8_ACTIVATIONS=7): the inputs quantized to 63 steps a side
    by the definition, the product exact, the same with the compiled library and without;
    `quantize_linears` reads the variable and refuses other values."""
    import aiayn.fast.int8_ops as tr
    from aiayn.fast import native
    from aiayn.fast.inference import quantize_linears

    torch.manual_seed(2)
    lin = torch.nn.Linear(96, 40).requires_grad_(False)
    layer = Int8Linear(lin)
    layer.act_bits = 7
    x = torch.randn(11, 96) * 3
    qw, sw = _quantized(lin.weight)
    amax = x.double().abs().amax(dim=1, keepdim=True)
    qx = torch.round(x.double() * (63 / amax))
    exact = (qx @ qw.t()) * (amax / 63) * sw.t() + lin.bias.double()
    got = {"native": layer(x)}
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(tr, "backend", lambda: "float")
    layer._weight = tr.Int8Weight(layer.weight_int8)
    got["torch ops"] = layer(x)
    monkeypatch.undo()
    for name, y in got.items():
        torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-5, msg=name)
    eight = Int8Linear(lin)
    assert not torch.equal(eight(x), got["native"])  # not the 8-bit layer's values
    monkeypatch.setenv("AIAYN_INT8_ACTIVATIONS", "7")
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert model[0].act_bits == 7 and "7-bit" in repr(model)
    monkeypatch.setenv("AIAYN_INT8_ACTIVATIONS", "6")
    with pytest.raises(ValueError, match="AIAYN_INT8_ACTIVATIONS"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_int8_ffn_second_layer_reads_its_relu_input_without_signs() -> None:
    """`quantize_linears` marks exactly the FFNs' second layers (`nonneg_input`: their
    input is max(0, .), Eq. 2), whose products then take aiayn's kernel without sign moves;
    the FFN's output is bit for bit the one with the signed kernel, in every layer."""
    from aiayn.fast.inference import quantize_linears
    from aiayn.model import PositionwiseFeedForward

    torch.manual_seed(3)
    model = quantize_linears(
        Transformer(
            ModelConfig(N=2, d_model=64, d_ff=200, h=4, d_k=16, d_v=16, vocab_size=50)
        ).eval()
    )
    marked = {n for n, m in model.named_modules() if getattr(m, "nonneg_input", False)}
    ffns = {n for n, m in model.named_modules() if isinstance(m, PositionwiseFeedForward)}
    assert marked == {f"{n}.w_2" for n in ffns} and len(marked) == 4
    x = torch.randn(3, 7, 64) * 2
    for name in ffns:
        ffn = model.get_submodule(name)
        with torch.no_grad():
            fast = ffn(x)
            ffn.w_2.nonneg_input = False
            signed = ffn(x)
            ffn.w_2.nonneg_input = True
        assert torch.equal(fast, signed), name


def test_tune_alpha_keeps_the_alpha_whose_translations_match_the_references(
    model: EosRamp, tmp_path
) -> None:
    """The recipe's alpha search (section 6.1: alpha chosen on the development set): with
    the references set to one alpha's own translations, that alpha must be chosen."""
    from aiayn.experiments.tasks.translation import tune_alpha

    lines = sentences(16, seed=3)
    src = tmp_path / "val.src"
    src.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    by_alpha = {a: translate_lines(model, TOK, lines, replace(CFG, alpha=a)) for a in (0.0, 1.4)}
    assert by_alpha[0.0] != by_alpha[1.4]  # the length penalty changes this model's outputs
    for target, outputs in by_alpha.items():
        ref = tmp_path / f"ref.{target}"
        ref.write_text("".join(x + "\n" for x in outputs), encoding="utf-8")
        decode, record = tune_alpha(
            model, TOK, src, ref, "en", CFG, (0.0, 1.4), tmp_path / f"tune{target}"
        )
        assert decode.alpha == record["chosen"] == target and decode.beam == CFG.beam
        scores = {r["alpha"]: r["sacrebleu"] for r in record["tried"]}
        assert scores[target] == pytest.approx(100.0) and scores[1.4 - target] < 99.0
        kept = (tmp_path / f"tune{target}" / f"alpha{target:g}.hyp").read_text(encoding="utf-8")
        assert kept.splitlines() == outputs


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_bf16_decoding_warns_where_bf16_is_slower_than_fp32(monkeypatch, caplog, dtype):
    import aiayn.fast.machine as translate_module

    monkeypatch.setattr(
        translate_module, "slow_bf16_warning", lambda device: f"bf16 is slow on {device}"
    )
    model = fast_transformer(
        ModelConfig(N=1, d_model=32, h=2, d_k=16, d_v=16, d_ff=64, P_drop=0.0, vocab_size=50)
    ).eval()
    with caplog.at_level(logging.WARNING, logger="aiayn.decoding.translate"):
        cast_for_inference(model, dtype)
    assert ("bf16 is slow on cpu" in caplog.text) == (dtype == "bf16")


def test_tune_alpha_screens_a_model_that_is_not_usable_before_the_grid(
    model: EosRamp, tmp_path
) -> None:
    """With more validation sentences than the screen, the first ones are decoded at the
    grid's first alpha; a model scoring below UNUSABLE_BLEU there (references that share
    no word with its outputs) keeps the configured alpha and no alpha is decoded."""
    from aiayn.experiments.tasks.translation import UNUSABLE_BLEU, tune_alpha

    lines = sentences(12, seed=3)
    src = tmp_path / "val.src"
    src.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    ref = tmp_path / "val.ref"
    ref.write_text("zzz qqq\n" * len(lines), encoding="utf-8")
    decode, record = tune_alpha(
        model, TOK, src, ref, "en", CFG, (0.0, 1.4), tmp_path / "tune", screen=5
    )
    assert decode == CFG and record["skipped"] and record["tried"] == []
    assert record["screen"]["sentences"] == 5 and record["screen"]["sacrebleu"] < UNUSABLE_BLEU
    assert not list((tmp_path / "tune").glob("alpha*.hyp"))
    # a usable model goes on to the grid after the screen
    good = tmp_path / "good.ref"
    good.write_text(
        "".join(x + "\n" for x in translate_lines(model, TOK, lines, CFG)), encoding="utf-8"
    )
    decode, record = tune_alpha(
        model, TOK, src, good, "en", CFG, (0.0, 1.4), tmp_path / "tune2", screen=5
    )
    assert "skipped" not in record and len(record["tried"]) == 2
    assert record["sentences"] == 12


def test_a_model_near_bleu_0_is_reported_as_not_trained_enough() -> None:
    from aiayn.experiments.tasks.translation import USABLE_STEPS, not_trained_enough

    train = {"steps": 5, "train_seconds": 600.0, "tokens": 60_000}
    flag = not_trained_enough(0.0, train, 10, "fp32")
    assert flag is not None and flag["steps"] == 5 and flag["tokens_per_s"] == 100.0
    # 5 steps in 10 minutes: USABLE_STEPS take 10 * USABLE_STEPS / 5 minutes, in fives
    assert flag["suggested_minutes"] == 10 * USABLE_STEPS // 5
    msg = flag["message"]
    assert msg.startswith("not trained enough: 5 steps in 10.0 minutes at 100 tokens/s")
    assert f"MINUTES={flag['suggested_minutes']}" in msg and "fp32" in msg
    assert not_trained_enough(25.0, train, 10, "fp32") is None
