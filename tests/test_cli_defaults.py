"""A default is written once (issue 69): every command-line flag named like a config field
(`--max-len`: train.max_len, `--beam`: decode.beam, ...) defaults to None (the config then
decides) or to the config dataclass's own default; the few that differ on purpose are
listed here with why."""

from __future__ import annotations

import argparse
import dataclasses

from aiayn.cli.parser import build_parser
from aiayn.config import DecodeConfig, ModelConfig, TrainConfig
from aiayn.experiments.recipe_config import RecipeConfig

#: (command, flag's dest): why its default is not the config's.
DIFFERENT_ON_PURPOSE = {
    ("bench", "vocab_size"): "the benchmark's synthetic vocabulary, the peers' protocol",
    ("info", "vocab_size"): "the paper's 37,000 shared pieces, for Table 3's parameter counts",
    ("attention", "dtype"): "the pictures in fp32: attention weights, not speed",
    ("score", "dtype"): "log-probabilities are measurements: fp32 unless asked, not speed",
}


def config_defaults() -> dict[str, list[object]]:
    found: dict[str, list[object]] = {}
    for cls in (TrainConfig, DecodeConfig, ModelConfig, RecipeConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                found.setdefault(f.name, []).append(f.default)
    return found


def flag_defaults() -> list[tuple[str, str, object]]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [
        (command, a.dest, a.default)
        for command, p in sub.choices.items()
        for a in p._actions
        if a.default not in (None, argparse.SUPPRESS)
    ]


def test_flags_named_like_a_config_field_default_to_the_configs_value():
    fields = config_defaults()
    wrong = [
        f"aiayn {command} --{dest.replace('_', '-')}: {default!r}, the config's {fields[dest]}"
        for command, dest, default in flag_defaults()
        if dest in fields
        and default not in fields[dest]
        and (command, dest) not in DIFFERENT_ON_PURPOSE
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_drifted_default_and_each_listed_exception_still_differs():
    fields = config_defaults()
    assert 256 in fields["max_len"] and ("prepare", "max_len", 256) in flag_defaults()
    assert 255 not in fields["max_len"]  # a drift to 255 would be reported
    listed = {(c, d): v for c, d, v in flag_defaults() if (c, d) in DIFFERENT_ON_PURPOSE}
    assert set(listed) == set(DIFFERENT_ON_PURPOSE)
    assert all(v not in fields[d] for (_, d), v in listed.items())
