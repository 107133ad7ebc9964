"""model.norm = "pre" (issue 73): each sublayer as x + Dropout(Sublayer(LayerNorm(x))),
each stack ending in a LayerNorm; the paper's post-norm stays the default and its
parameters unchanged; the fast model, incremental decoding, checkpoints and the exports
follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from aiayn.checkpoints import load_model
from aiayn.config import BOS_ID, ModelConfig, apply_overrides, get_preset
from aiayn.fast import accelerate
from aiayn.model import DecoderLayer, EncoderLayer, Transformer, count_parameters, parameter_formula
from helpers import random_checkpoint, random_src

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(
    N=2, d_model=32, d_ff=64, h=2, d_k=16, d_v=16, P_drop=0.0, vocab_size=40, norm="pre"
)


def _randomise_norms(model: nn.Module) -> None:
    """LayerNorm gains and biases away from 1 and 0, so that a norm left out shows."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.5 * torch.randn(m.bias.shape, generator=g))


def test_a_pre_norm_encoder_layer_is_x_plus_sublayer_of_layer_norm_x() -> None:
    torch.manual_seed(0)
    layer = EncoderLayer(CFG).eval()
    _randomise_norms(layer)
    x = torch.randn(3, 5, 32)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    mask[0, ..., 3:] = False
    with torch.no_grad():
        h = x + layer.self_attn(layer.norm1(x), mask=mask)
        expected = h + layer.ffn(layer.norm2(h))
        assert torch.allclose(layer(x, mask), expected, atol=1e-6)
        # and not the post-norm formula
        post = layer.norm1(x + layer.self_attn(x, mask=mask))
        assert not torch.allclose(layer(x, mask), layer.norm2(post + layer.ffn(post)))


def test_a_pre_norm_decoder_layer_is_x_plus_sublayer_of_layer_norm_x() -> None:
    torch.manual_seed(0)
    layer = DecoderLayer(CFG).eval()
    _randomise_norms(layer)
    y, memory = torch.randn(2, 4, 32), torch.randn(2, 6, 32)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    with torch.no_grad():
        a = y + layer.self_attn(layer.norm1(y), causal=True)
        b = a + layer.cross_attn(layer.norm2(a), memory, mask)
        expected = b + layer.ffn(layer.norm3(b))
        assert torch.allclose(layer(y, memory, mask), expected, atol=1e-6)


def test_both_stacks_end_in_a_layer_norm() -> None:
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    _randomise_norms(model)
    src = random_src([5, 3])
    tgt = torch.tensor([[BOS_ID, 7, 8], [BOS_ID, 9, 4]])
    assert isinstance(model.encoder_norm, nn.LayerNorm)
    assert isinstance(model.decoder_norm, nn.LayerNorm)
    with torch.no_grad():
        mask = model.src_mask(src)
        x = model.src_embed(src)
        for layer in model.encoder:
            x = layer(x, mask)
        memory, _ = model.encode(src)
        assert torch.allclose(memory, model.encoder_norm(x), atol=1e-6)
        y = model.tgt_embed(tgt)
        for layer in model.decoder:
            y = layer(y, memory, mask)
        assert torch.allclose(model(src, tgt), model.generator(model.decoder_norm(y)), atol=1e-5)


def test_post_norm_stays_the_default_with_the_papers_parameters() -> None:
    assert ModelConfig().norm == "post" and get_preset("base").model.norm == "post"
    post = Transformer(ModelConfig(**{**CFG.__dict__, "norm": "post"}))
    pre = Transformer(CFG)
    assert post.encoder_norm is None and post.decoder_norm is None
    extra = set(pre.state_dict()) - set(post.state_dict())
    assert extra == {f"{s}_norm.{p}" for s in ("encoder", "decoder") for p in ("weight", "bias")}
    for model in (post, pre):
        assert count_parameters(model) == parameter_formula(model.cfg)
    with pytest.raises(ValueError, match="model.norm"):
        apply_overrides(get_preset("tiny"), {"model.norm": "middle"})


def test_the_fast_model_and_incremental_decoding_follow() -> None:
    """The fast model (eval, and training with padding packed out) equals the paper's;
    decode_step equals the last row of the teacher-forced decoder."""
    torch.manual_seed(0)
    paper = Transformer(CFG)
    _randomise_norms(paper)
    fast = accelerate(Transformer(CFG))
    fast.load_state_dict(paper.state_dict())
    src = random_src([5, 2, 7])
    tgt = torch.tensor([[BOS_ID, 7, 8, 9], [BOS_ID, 9, 0, 0], [BOS_ID, 4, 5, 0]])
    for train in (False, True):
        paper.train(train), fast.train(train)
        with torch.no_grad():
            a, b = paper(src, tgt), fast(src, tgt)
        real = tgt != 0
        assert torch.allclose(a[real], b[real], atol=1e-5)
    fast.eval()
    with torch.no_grad():
        memory, mask = fast.encode(src)
        states = fast.init_state(memory, 8)
        for t in range(4):
            step = fast.decode_step(tgt[:, t : t + 1], mask, states)
            full = fast.decode(tgt[:, : t + 1], memory, mask)[:, -1]
            assert torch.allclose(step, full, atol=1e-5)


def test_the_int8_beam_steps_hidden_state_is_after_the_final_norm() -> None:
    """An int8 output layer finds the beam's best tokens from `decode_hidden`
    (`registry.step_topk`): for pre-LN that must be the decoder's normed output, so that the
    output layer applied to it is `decode_step`."""
    torch.manual_seed(1)
    paper = Transformer(CFG)
    _randomise_norms(paper)
    fast = accelerate(Transformer(CFG))
    fast.load_state_dict(paper.state_dict())
    fast.eval()
    src = random_src([5, 2, 7])
    tokens = torch.tensor([[BOS_ID, 7, 8, 9], [BOS_ID, 9, 4, 6], [BOS_ID, 4, 5, 3]])
    with torch.no_grad():
        memory, mask = fast.encode(src)
        whole, hidden = fast.init_state(memory, 8), fast.init_state(memory, 8)
        for t in range(4):
            step = fast.decode_step(tokens[:, t : t + 1], mask, whole)
            via_hidden = fast.generator(fast.decode_hidden(tokens[:, t : t + 1], mask, hidden))
            assert torch.allclose(step, via_hidden, atol=1e-5)


def test_checkpoints_record_it(tmp_path: Path) -> None:
    ckpt = random_checkpoint(tmp_path / "pre.pt", norm="pre")
    model, _, cfg = load_model(ckpt)
    assert cfg.model.norm == "pre" and model.decoder_norm is not None
    post = random_checkpoint(tmp_path / "post.pt")
    model, _, cfg = load_model(post)
    assert cfg.model.norm == "post" and model.decoder_norm is None
    # a config written before the option existed reads as the paper's post-norm
    from aiayn.config import Config

    old = Config().to_dict()
    del old["model"]["norm"]
    assert Config.from_dict(old).model.norm == "post"
