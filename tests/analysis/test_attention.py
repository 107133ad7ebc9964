"""The attention figures (Figures 3-5) on a tiny trained model: every head's weights are
distributions over the right tokens, the decoder's are causal (section 3.2.3), the
numbers written are the model's, and the pictures are images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aiayn.analysis.attention import KINDS, attention_maps, find_word, record_attention
from aiayn.checkpoints import load_model
from aiayn.config import BOS_ID, DecodeConfig
from aiayn.decoding.search import greedy_search
from aiayn.files import UsageError
from aiayn.model import MultiHeadAttention, attention_weights
from aiayn.training.trainer import train
from helpers import SMALL_TRAINING, cli, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "Two young men are playing football on a green field ."
GREEDY = DecodeConfig(beam=1, max_len_a=1.0, max_len_b=10)


@pytest.fixture(scope="module")
def checkpoint(small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-step run of the small test model with two layers (h=2), with its tokenizer;
    its outputs capped at 12 tokens (it has not learned to stop: pictures of 60 tokens
    take matplotlib seconds each)."""
    run = tmp_path_factory.mktemp("attention") / "run"
    cfg = {**SMALL_TRAINING, "max_steps": 10, "N": 2, "decode.max_len_a": 0, "decode.max_len_b": 12}
    train(tiny_config(cfg), small_data, run)
    return run / "checkpoint_last.pt"


def test_every_head_is_a_distribution_over_the_tokens(checkpoint: Path) -> None:
    """Eq. 1: each row of each head is a softmax, so it sums to 1; the shapes are the
    tokens' (source with EOS; decoder inputs BOS + translation)."""
    model, tokenizer, _ = load_model(checkpoint)
    maps = attention_maps(model, tokenizer, TEXT, GREEDY)
    S, T = len(maps.source_tokens), len(maps.target_tokens)
    assert len(tokenizer.encode(TEXT)) + 1 == S and T >= 2
    assert maps.target_ids[0] == BOS_ID and maps.target_tokens[0] == tokenizer.id_to_piece(BOS_ID)
    shapes = {"encoder_self": (S, S), "decoder_self": (T, T), "encoder_decoder": (T, S)}
    for kind in KINDS:
        assert len(maps.weights[kind]) == model.cfg.N == 2
        for w in maps.weights[kind]:
            assert w.shape == (model.cfg.h, *shapes[kind])
            assert (w >= 0).all()
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))


def test_decoder_self_attention_is_causal(checkpoint: Path) -> None:
    """Section 3.2.3: no position attends to a later one; the rest is not all zero."""
    model, tokenizer, _ = load_model(checkpoint)
    maps = attention_maps(model, tokenizer, TEXT, GREEDY)
    for w in maps.weights["decoder_self"]:
        assert torch.triu(w, diagonal=1).eq(0).all()
        assert torch.tril(w, diagonal=-1).gt(0).any()  # negative control: below is used


def test_recording_changes_nothing_and_is_switched_off_after(checkpoint: Path) -> None:
    """The translation is the model's own greedy output, the logits are the same with
    recording on, and every layer's record flag is back off."""
    model, tokenizer, _ = load_model(checkpoint)
    maps = attention_maps(model, tokenizer, TEXT, GREEDY)
    src = torch.tensor([maps.source_ids])
    assert maps.target_ids[1:] == greedy_search(model, src, 1.0, 10)[0]
    assert maps.translation == tokenizer.decode(maps.target_ids[1:])
    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert len(modules) == 3 * model.cfg.N
    assert not any(m._forward_hooks for m in modules)  # the observer is gone
    tgt = torch.tensor([maps.target_ids])
    with torch.inference_mode():
        before = model(src, tgt)
    record_attention(model, src, tgt)
    with torch.inference_mode():
        torch.testing.assert_close(model(src, tgt), before, rtol=0, atol=0)


def test_find_word_takes_a_subword_or_a_position() -> None:
    tokens = ["\u2581The", "\u2581dog", "s", "</s>"]
    assert find_word(tokens, "dog") == 1
    assert find_word(tokens, "\u2581dog") == 1
    assert find_word(tokens, "3") == 2
    with pytest.raises(UsageError, match="not a source token"):
        find_word(tokens, "cat")
    with pytest.raises(UsageError, match="1..4"):
        find_word(tokens, "5")


def test_attention_command_writes_pictures_and_the_models_numbers(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "att"
    code, stdout, err = cli(
        *("attention", "--checkpoint", checkpoint, "--text", TEXT, "--out", out),
        *("--word", "2", "--layer", "2", "--beam", "1", "--json"),
    )
    assert code == 0, err
    assert "translation:" in stdout
    pictures = {f"{kind}_layer2.png" for kind in KINDS}
    pictures |= {"encoder_lines_layer2.png", "word_layer2.png"}
    assert {p.name for p in out.iterdir()} == pictures | {"attention.json"}  # --layer 2 only
    for name in pictures:
        assert_png(out / name)

    data = json.loads((out / "attention.json").read_text(encoding="utf-8"))
    # the numbers are what the paper's model (no speed paths) computes on those tokens
    paper, tokenizer, _ = load_model(checkpoint, fast=False)
    src, tgt = torch.tensor([data["source_ids"]]), torch.tensor([data["target_ids"]])
    assert data["source_tokens"] == [tokenizer.id_to_piece(i) for i in data["source_ids"]]
    expected = record_attention(paper, src, tgt)
    for kind in KINDS:
        got = torch.tensor(data[kind])
        torch.testing.assert_close(got, torch.stack(expected[kind]), rtol=1e-5, atol=1e-6)
    # and encoder layer 1 by hand, Eq. 1 on the projected embeddings
    attn = paper.encoder[0].self_attn
    with torch.no_grad():
        q, k, _ = attn.w_qkv(paper.src_embed(src)).chunk(3, dim=-1)
        by_hand = attention_weights(attn.split_heads(q, attn.d_k), attn.split_heads(k, attn.d_k))
    torch.testing.assert_close(torch.tensor(data["encoder_self"][0]), by_hand[0])


def test_attention_refuses_a_layer_the_model_lacks(checkpoint: Path, tmp_path: Path) -> None:
    code, _, err = cli(
        *("attention", "--checkpoint", checkpoint, "--text", TEXT, "--out", tmp_path),
        *("--layer", "3", "--beam", "1"),
    )
    assert code == 2 and "--layer 3: the model has 1..2" in err, err


def assert_png(path: Path) -> None:
    """A PNG file that an image reader decodes into a picture of some size."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
