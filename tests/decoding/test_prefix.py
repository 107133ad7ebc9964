"""Prefix-constrained decoding (issue 73): `translate --prefix` on the beam search's
constraint hook (`ForcedPrefix`). Every output begins with its prefix; a prefix that is the
start of the unconstrained search's own best output gives that output back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiayn.checkpoints import load_model
from aiayn.decoding.constraints import ForcedPrefix
from aiayn.decoding.search import beam_search
from aiayn.decoding.translate import prefix_constraint, translate_nbest
from helpers import (
    LENGTHS,
    A,
    B,
    assert_one_line_error,
    cli,
    eos_ramp_model,
    hand_table,
    random_checkpoint,
    random_src,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = torch.tensor([[7, 3]])  # the hand table reads no source


def test_on_the_hand_table_the_prefix_picks_the_subtree_searched() -> None:
    """Beam 2, alpha 0 (score = log P), worked in tests/decoding/test_search.py: the free
    best is "B" (.225), runner-up "B A A" (.1904). Forcing "B" gives "B" back; forcing "A"
    gives the best output that starts with A ("A EOS", .2: greedy's answer); forcing "B A"
    gives "B A A"."""
    expected = {(B,): [B], (A,): [A], (B, A): [B, A, A]}
    free = beam_search(hand_table(), SRC, beam=2, alpha=0.0, max_len_a=0.0, max_len_b=10)
    assert free[0][0].tokens == [B]
    for prefix, best in expected.items():
        forced = ForcedPrefix([list(prefix)], vocab_size=6, device="cpu")
        (hyps,) = beam_search(hand_table(), SRC, 2, 0.0, 0.0, 10, constraint=forced)
        assert hyps[0].tokens == best
    (hyps,) = beam_search(
        hand_table(), SRC, 2, 0.0, 0.0, 10, constraint=ForcedPrefix([[A]], 6, "cpu")
    )
    assert hyps[0].log_prob == pytest.approx(float(torch.tensor(0.5 * 0.4).log()), abs=1e-5)


@pytest.mark.parametrize("make", [eos_ramp_model, tiny_model], ids=["eos-ramp", "tiny"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_with_its_own_outputs_start_gives_the_same_outputs(make, k) -> None:
    """Greedy's choice at each step depends on the prefix alone, so forcing the first k
    tokens of its own output changes nothing: same tokens, same scores, every sentence of
    the batch (lengths differ, prefixes of different lengths end at different steps)."""
    model, src = make(), random_src(LENGTHS)
    free = beam_search(model, src, 1, 0.6, 1.0, 10)
    prefixes = [h[0].tokens[:k] for h in free]
    forced = beam_search(
        model, src, 1, 0.6, 1.0, 10, constraint=ForcedPrefix(prefixes, model.cfg.vocab_size, "cpu")
    )
    for f, g in zip(free, forced, strict=True):
        assert g[0].tokens == f[0].tokens
        assert g[0].score == pytest.approx(f[0].score, abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_beam_output_begins_with_its_prefix(seed) -> None:
    """Beam 4, nbest 4, random prefixes (some longer than the free outputs, one empty):
    every returned hypothesis begins with its sentence's prefix."""
    model, src = tiny_model(seed), random_src(LENGTHS, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(4, 40, (int(n) % 4,), generator=g).tolist() for n in LENGTHS]
    cap = ForcedPrefix(prefixes, model.cfg.vocab_size, "cpu")
    out = beam_search(model, src, 4, 0.6, 1.0, 10, nbest=4, constraint=cap)
    for hyps, prefix in zip(out, prefixes, strict=True):
        assert hyps and all(h.tokens[: len(prefix)] == prefix for h in hyps)


def test_translate_prefix_from_the_command_line(tmp_path: Path) -> None:
    """`aiayn translate --prefix FILE`: each output line begins with its prefix's subwords
    (text: the prefix, then the rest); a blank prefix leaves its line as without --prefix;
    a prefix file of another length, stdin, or --sampling is refused by name."""
    ckpt = random_checkpoint(tmp_path / "model.pt")
    src = tmp_path / "src.txt"
    src.write_text("abc de fgh\nij a bcd e\nbb cc\n", encoding="utf-8")
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("ab cd\n\nj\n", encoding="utf-8")
    code, free, err = cli("translate", "--checkpoint", ckpt, "--input", src, "--no-progress")
    assert code == 0, err
    code, out, err = cli(
        "translate", "--checkpoint", ckpt, "--input", src, "--prefix", prefix, "--no-progress"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("ab cd") and lines[2].startswith("j")
    assert lines[1] == free.splitlines()[1]  # a blank prefix: free

    model, tok, cfg = load_model(ckpt, fast=False)
    texts = src.read_text(encoding="utf-8").splitlines()
    forced = prefix_constraint(tok, ["ab cd", "", "j"], tok.vocab_size)
    nbest, _ = translate_nbest(model, tok, texts, cfg.decode, constraint_for=forced)
    want = tok.encode("ab cd")
    assert all(list(h.tokens[: len(want)]) == want for h in nbest[0])
    assert [n[0].text for n in nbest] == lines

    prefix.write_text("ab\n", encoding="utf-8")
    code, _, err = cli("translate", "--checkpoint", ckpt, "--input", src, "--prefix", prefix)
    assert code != 0 and "1 prefix lines for the 3 lines" in err
    code, _, err = cli("translate", "--checkpoint", ckpt, "--prefix", prefix)
    assert_one_line_error(err, "--prefix needs --input FILE")
    code, _, err = cli(
        "translate", "--checkpoint", ckpt, "--input", src, "--prefix", prefix, "--sampling"
    )
    assert_one_line_error(err, "--prefix needs --input FILE")


def test_the_python_api_takes_prefixes(tmp_path: Path) -> None:
    """`Translator.translate(lines, prefixes=...)`: what `translate --prefix` gives."""
    import aiayn

    ckpt = random_checkpoint(tmp_path / "model.pt")
    t = aiayn.Translator.load(ckpt, dtype="fp32")
    lines = ["abc de fgh", "ij a bcd e"]
    out = t.translate(lines, beam=2, prefixes=["ab cd", "j"])
    assert out[0].startswith("ab cd") and out[1].startswith("j")
    src, prefix = tmp_path / "src.txt", tmp_path / "prefix.txt"
    src.write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
    prefix.write_text("ab cd\nj\n", encoding="utf-8")
    code, cmd, err = cli(
        "translate",
        "--checkpoint",
        ckpt,
        "--input",
        src,
        "--prefix",
        prefix,
        "--beam",
        "2",
        "--dtype",
        "fp32",
        "--no-progress",
    )
    assert code == 0, err
    assert cmd.splitlines() == out
    with pytest.raises(ValueError, match="1 prefixes for 2 lines"):
        t.translate(lines, prefixes=["ab"])
