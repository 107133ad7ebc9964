"""Help formatting shared by the subcommands' parsers, and the flags `train` and `info` share.

Help text is argparse's: a literal % is written %%. Defaults that come from elsewhere (a
preset, a checkpoint) are None in the parser and each such flag says "(default: ...)" itself.
"""

from __future__ import annotations

import argparse
import textwrap

from aiayn.config import PRESETS, get_preset


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help that shows each flag's default and keeps examples in epilogs as written.

    A flag whose default is None (its value comes from elsewhere: the preset, the
    checkpoint) says so in its own help, "(default: ...)", and gets nothing appended.
    In descriptions and epilogs, a paragraph with an indented line (examples, tables) is
    kept as written; other paragraphs are filled to the terminal's width.
    """

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or action.default is None or action.required:
            return text
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            lines = paragraph.splitlines()
            if any(line.startswith(" ") for line in lines):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(
                    textwrap.fill(
                        " ".join(lines), width, initial_indent=indent, subsequent_indent=indent
                    )
                )
        return "\n\n".join(paragraphs)


BASE = get_preset("base")


def preset_help() -> str:
    """--preset's help: every preset by name, from aiayn.config."""
    return (
        f"model and training settings to start from: {', '.join(PRESETS)} (the paper's "
        "base and big models, a model small enough for a CPU, and the rows of Table 3 "
        "as changes of base)"
    )


def command_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    epilog: str,
) -> argparse.ArgumentParser:
    """A subcommand's parser: `summary` is its line in `aiayn --help` and its description."""
    return sub.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog=epilog,
        formatter_class=HelpFormatter,
    )


def from_preset(key: str) -> str:
    """ "(default: ...)" for a flag that overrides config `key`, with the base preset's value."""
    section, name = key.split(".")
    value = getattr(getattr(BASE, section), name)
    return f"(default: the preset's or --config file's {key}; base: {value})"


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--preset or --config, then --set: the configuration of `train` and `info`."""
    g = p.add_mutually_exclusive_group()
    # default None, not "base": argparse does not see a conflict when the value given
    # is the default object itself (`--preset base --config x.toml` would pass silently)
    g.add_argument("--preset", metavar="NAME", help=preset_help() + " (default: base)")
    g.add_argument(
        "--config",
        metavar="FILE.toml",
        help='experiment file: `preset = "tiny"` plus [model], [train] and [decode] '
        "tables of overrides, e.g. configs/multi30k-en-de.toml (default: none; "
        "not with --preset)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override any config field, as section.name or, where unambiguous, "
        "name (--set P_drop=0.3, --set train.max_tokens=2048); repeatable; "
        "applied last, after the other flags (default: none)",
    )
