"""The paper's model (aiayn.model) against the paper's formulas (section 3) and PyTorch's
own attention."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from aiayn.config import PAD_ID, PRESETS, ModelConfig
from aiayn.model import (
    KVCache,
    MultiHeadAttention,
    Transformer,
    attention_weights,
    count_parameters,
    parameter_formula,
    scaled_dot_product_attention,
    sinusoidal_positions,
)

SMALL = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=12, P_drop=0.1, vocab_size=50)


def small_model(**changes: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(replace(SMALL, **changes)).double().eval()


def literal_attention(q, k, v, mask=None):
    """Eq. 1 written out: softmax(Q K^T / sqrt(d_k)) V with -inf at illegal connections."""
    d_k = q.shape[-1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d_k)
    if mask is not None:
        scores = torch.where(mask, scores, torch.tensor(float("-inf"), dtype=scores.dtype))
    w = torch.exp(scores - scores.amax(-1, keepdim=True))
    w = w / w.sum(-1, keepdim=True)
    return torch.einsum("bhqk,bhkd->bhqd", w, v)


def test_attention_equals_eq1_in_float64():
    """Section 3.2.1, Eq. 1, with a padding mask, in float64."""
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64),
    )
    v = torch.randn(2, 3, 7, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., 4:] = False
    causal = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)  # queries = last 5 keys
    for _ in (1,):
        torch.testing.assert_close(
            scaled_dot_product_attention(q, k, v, mask),
            literal_attention(q, k, v, mask),
            rtol=1e-12,
            atol=1e-12,
        )
        torch.testing.assert_close(
            scaled_dot_product_attention(q, k, v, causal=True),
            literal_attention(q, k, v, causal),
            rtol=1e-12,
            atol=1e-12,
        )
        torch.testing.assert_close(
            scaled_dot_product_attention(q, k, v, mask, causal=True),
            literal_attention(q, k, v, mask & causal),
            rtol=1e-12,
            atol=1e-12,
        )


def test_attention_weights_rows_sum_to_one_and_respect_mask():
    """Section 3.2.1: a softmax over keys; masked keys (section 3.2.3) get weight exactly 0."""
    q, k = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 3:] = False
    w = attention_weights(q, k, mask)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 4))
    assert torch.all(w[0, ..., 3:] == 0)


def test_multihead_matches_torch_multiheadattention():
    """Section 3.2.2: Concat(head_1..head_h) W^O equals nn.MultiheadAttention (no biases)."""
    torch.manual_seed(0)
    d, h = 32, 4
    ours = MultiHeadAttention(d, h, d // h, d // h, self_attention=True).double()
    ref = nn.MultiheadAttention(d, h, bias=False, batch_first=True).double()
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.w_qkv.weight)
        ref.out_proj.weight.copy_(ours.w_o.weight)
    x = torch.randn(3, 6, d, dtype=torch.float64)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[2, 4:] = True  # torch: True = ignore
    expected, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    got = ours(x, mask=~pad[:, None, None, :])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_multihead_separate_dk_dv_shapes():
    """Table 3 rows A/B: d_k and d_v are independent and h*d_k may differ from d_model."""
    mha = MultiHeadAttention(32, 3, 5, 7, self_attention=False)
    assert mha.w_q.weight.shape == (15, 32)
    assert mha.w_kv.weight.shape == (15 + 21, 32)
    assert mha.w_o.weight.shape == (32, 21)
    out = mha(torch.randn(2, 4, 32), torch.randn(2, 9, 32))
    assert out.shape == (2, 4, 32)


def test_sinusoids_match_the_formula():
    """Section 3.5: PE(pos,2i) = sin(pos/10000^(2i/d)), PE(pos,2i+1) = cos(same)."""
    d = 16
    pe = sinusoidal_positions(50, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_embeddings_scaled_by_sqrt_d_model_plus_positions():
    """Section 3.4: embedding weights multiplied by sqrt(d_model); section 3.5: PE added."""
    m = small_model()
    tokens = torch.tensor([[5, 6, 7]])
    expected = m.src_embed.token.weight[tokens] * math.sqrt(32) + sinusoidal_positions(3, 32)
    torch.testing.assert_close(m.src_embed(tokens), expected.double())


def test_one_shared_weight_matrix():
    """Section 3.4: source, target embeddings and the pre-softmax linear share one matrix."""
    m = small_model()
    assert m.src_embed.token.weight is m.tgt_embed.token.weight is m.generator.weight
    unshared = small_model(share_embeddings=False)
    assert unshared.src_embed.token.weight is not unshared.generator.weight


def test_future_tokens_do_not_change_past_outputs():
    """Section 3.2.3: decoder self-attention is masked so position i sees only < i+1."""
    m = small_model()
    src = torch.randint(4, 50, (2, 6))
    tgt = torch.randint(4, 50, (2, 8))
    out = m(src, tgt)
    tgt2 = tgt.clone()
    tgt2[:, 5:] = torch.randint(4, 50, (2, 3))
    out2 = m(src, tgt2)
    torch.testing.assert_close(out[:, :5], out2[:, :5], rtol=0, atol=1e-12)
    assert not torch.allclose(out[:, 5:], out2[:, 5:])


def test_padding_does_not_change_real_positions():
    """Section 3.2.3: padded source keys are masked; right-padding the target is invisible."""
    m = small_model()
    src = torch.randint(4, 50, (1, 5))
    tgt = torch.randint(4, 50, (1, 4))
    out = m(src, tgt)
    src_pad = torch.cat([src, torch.full((1, 3), PAD_ID)], 1)
    tgt_pad = torch.cat([tgt, torch.full((1, 2), PAD_ID)], 1)
    torch.testing.assert_close(m(src_pad, tgt_pad)[:, :4], out, rtol=0, atol=1e-12)


def test_post_norm_layer_output_is_normalised():
    """Section 3.1: each sub-layer output is LayerNorm(x + Sublayer(x)), so it is normalised."""
    m = small_model()
    x = torch.randn(2, 5, 32, dtype=torch.float64) * 3 + 1
    y = m.encoder[0](x, torch.ones(2, 1, 1, 5, dtype=torch.bool))
    torch.testing.assert_close(
        y.mean(-1), torch.zeros(2, 5, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_dropout_active_only_in_training():
    """Section 5.4: P_drop on sub-layer outputs and embedding sums, none at inference."""
    m = small_model()
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 5))
    torch.testing.assert_close(m(src, tgt), m(src, tgt))
    m.train()
    assert not torch.allclose(m(src, tgt), m(src, tgt))
    m0 = small_model(P_drop=0.0).train()
    torch.testing.assert_close(m0(src, tgt), m0(src, tgt))


def test_incremental_decoding_equals_full_recomputation():
    """Section 6.1 inference: cached keys/values give the same logits as the full decoder."""
    m = small_model()
    src = torch.randint(4, 50, (3, 7))
    src[1, 5:] = PAD_ID
    tgt = torch.randint(4, 50, (3, 6))
    full = m(src, tgt)
    memory, mask = m.encode(src)
    states = m.init_state(memory, max_len=10)
    steps = [m.decode_step(tgt[:, i : i + 1], mask, states) for i in range(6)]
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-10, atol=1e-10)


def test_learned_positions_variant():
    """Table 3 row E: learned positional embeddings instead of sinusoids."""
    m = small_model(positional="learned")
    assert m.src_embed.learned is not None
    assert m(torch.randint(4, 50, (1, 4)), torch.randint(4, 50, (1, 3))).shape == (1, 3, 50)


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_matches_closed_form(name):
    """Table 3: every preset's parameters equal the closed-form count from section 3's shapes."""
    cfg = replace(PRESETS[name].model, vocab_size=1000)
    with torch.device("meta"):
        m = Transformer(cfg)
    assert count_parameters(m) == parameter_formula(cfg)


# Table 3's params column (millions), shared En-De vocabulary of ~37,000.
TABLE3_PARAMS = {
    "base": 65,
    "big": 213,
    "B1": 58,
    "B2": 60,
    "C1": 36,
    "C2": 50,
    "C3": 80,
    "C4": 28,
    "C5": 168,
    "C6": 53,
    "C7": 90,
}


@pytest.mark.parametrize("name", list(TABLE3_PARAMS))
def test_parameter_count_near_table3(name):
    """Table 3 params column, within 7%: the paper's exact vocabulary and biases are unstated."""
    cfg = replace(PRESETS[name].model, vocab_size=37000)
    millions = parameter_formula(cfg) / 1e6
    assert millions == pytest.approx(TABLE3_PARAMS[name], rel=0.07)


def test_kv_cache_reordering_equals_reordering_the_prefix():
    """The lazy beam reordering of the self-attention cache: after reorders between
    appends, the cache holds exactly the rows the reorders select, in order."""
    cache = KVCache(4, 2, 3, 3, torch.device("cpu"), torch.float64)
    ref_k = torch.empty(4, 2, 0, 3, dtype=torch.float64)
    for index in ([1, 1, 0, 3], [2, 0], [1, 0, 0]):  # shrinks to 2 rows, then grows to 3
        k = torch.randn(ref_k.size(0), 2, 1, 3, dtype=torch.float64)
        got_k, got_v = cache.append(k, k + 1)
        ref_k = torch.cat([ref_k, k], dim=2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_k + 1)
        assert got_k.is_contiguous()
        cache.reorder(torch.tensor(index))
        ref_k = ref_k[index]
    cache.reorder(torch.tensor([2, 0]))  # two reorders before the next append compose
    ref_k = ref_k[[2, 0]]
    k = torch.randn(2, 2, 1, 3, dtype=torch.float64)
    assert torch.equal(cache.append(k, k)[0], torch.cat([ref_k, k], dim=2))
    assert cache.length == 4
