"""Configuration: presets as Table 3 rows, overrides, and errors naming the key (J1, J2, J4)."""

from __future__ import annotations

import pytest

from aiayn.config import (
    PRESETS,
    Config,
    ConfigError,
    apply_overrides,
    get_preset,
    load_experiment,
    parse_set_args,
)


def test_base_is_the_paper_base_row():
    """Table 3 base row and section 5: N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1."""
    m, t = PRESETS["base"].model, PRESETS["base"].train
    assert (m.N, m.d_model, m.d_ff, m.h, m.d_k, m.d_v, m.P_drop) == (6, 512, 2048, 8, 64, 64, 0.1)
    assert (t.eps_ls, t.warmup_steps, t.beta1, t.beta2, t.adam_eps) == (0.1, 4000, 0.9, 0.98, 1e-9)
    assert m.positional == "sinusoidal" and m.share_embeddings


def test_rows_change_only_what_table3_changes():
    """Table 3: each variation row is base with the listed cells changed."""
    base = PRESETS["base"]
    assert PRESETS["A1"].model.h == 1 and PRESETS["A1"].model.d_k == 512
    assert PRESETS["B1"].model.d_k == 16 and PRESETS["B1"].model.d_v == 64
    assert PRESETS["C4"].model.d_model == 256 and PRESETS["C4"].model.d_k == 32
    assert PRESETS["D3"].train.eps_ls == 0.0 and PRESETS["D3"].model == base.model
    assert PRESETS["E"].model.positional == "learned"
    big = PRESETS["big"].model
    assert (big.d_model, big.d_ff, big.h, big.P_drop) == (1024, 4096, 16, 0.3)
    for name in ("A1", "A2", "A3", "A4"):  # constant compute: h * d_k = d_model
        assert PRESETS[name].model.h * PRESETS[name].model.d_k == 512


@pytest.mark.rows("J4")
def test_overrides_and_round_trip():
    """Overrides by section.key or bare key; the stored dict rebuilds the same config (J4)."""
    cfg = apply_overrides(
        get_preset("tiny"),
        {"model.N": "2", "eps_ls": "0.2", "beam": 5, "share_embeddings": "false"},
    )
    assert cfg.model.N == 2 and cfg.train.eps_ls == 0.2 and cfg.decode.beam == 5
    assert cfg.model.share_embeddings is False
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.rows("J1")
def test_unknown_key_names_the_closest():
    """J1: an unknown key is an error naming the closest valid key."""
    with pytest.raises(ConfigError, match="learnig_rate|warmup"):
        apply_overrides(get_preset("base"), {"warmup_step": "10"})
    with pytest.raises(ConfigError, match="did you mean 'P_drop'"):
        apply_overrides(get_preset("base"), {"p_drop": "0.1"})
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        get_preset("tinny")


@pytest.mark.rows("J2")
@pytest.mark.parametrize(
    "key,value,match",
    [
        ("P_drop", "1.5", "P_drop"),
        ("warmup_steps", "abc", "warmup_steps"),
        ("beam", "0", "beam"),
        ("lr_scale", "-1", "lr_scale"),
        ("N", "2.5", "N"),
    ],
)
def test_bad_values_name_the_key(key, value, match):
    """J2: bad type or range names the key and the constraint."""
    with pytest.raises(ConfigError, match=match):
        apply_overrides(get_preset("base"), {key: value})


def test_set_args_and_experiment_file(tmp_path):
    """STYLE: experiment files name a preset and override a few fields."""
    assert parse_set_args(["a=1", "b = x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError):
        parse_set_args(["novalue"])
    p = tmp_path / "exp.toml"
    p.write_text(
        'preset = "tiny"\n[model]\nP_drop = 0.3\n[train]\nwarmup_steps = 2000\n'
        '[recipe]\npair = "en-de"\n'
    )
    cfg, extra = load_experiment(p)
    assert cfg.model.P_drop == 0.3 and cfg.train.warmup_steps == 2000
    assert cfg.model.N == PRESETS["tiny"].model.N and extra == {"recipe": {"pair": "en-de"}}
    p.write_text('preset = "tiny"\n[model]\nd_modle = 3\n')
    with pytest.raises(ConfigError, match="exp.toml.*d_model"):
        load_experiment(p)
