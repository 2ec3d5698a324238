"""Settings declared once: each dataclass field made with `setting(...)` carries its launcher option, help text, how
the command line spells it, the Megatron switch it lowers to (for an on/off switch) and whether a benchmark row
records it. Everything else reads the declaration: the launcher's options and `--help` (`add_options`), the
overrides they give (`overrides_from`), the startup banner (`banner_lines`), the benchmark rows' run settings
(`settings_in`), the README's option table (`option_table`) and the plain on/off lowerings (`switch_flags`).

A field whose type is a dataclass and that carries no `setting(...)` is a group: its own fields are settings (or
groups) in turn. A dataclass-typed field made with `setting(...)` is one setting with a parser of its own (e.g.
`--recompute mamba,moe`). Each setting has a key unique in its tree (the field name unless `key=` says otherwise):
`get_recipe("proxy-1gpu", micro_batch=8)` and the launcher's namespace use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

ON_OFF = {"on": True, "off": False}


def on_off(text: str) -> bool:
    """'on' -> True, 'off' -> False."""
    if text not in ON_OFF:
        raise ValueError(text)
    return ON_OFF[text]


@dataclass(frozen=True)
class Setting:
    """What one field declares besides its type and default."""

    help: str = ""
    cli: str | None = None  # the launcher's option, e.g. "--mbs"; None: no option
    key: str | None = None  # the setting's unique name; default: the field's
    parse: Callable[[str], Any] | None = None  # command-line text to value; default: from the field's type
    metavar: str | None = None
    megatron: str | None = None  # an on/off switch: the Megatron flag it lowers to when on
    recorded: bool = False  # a benchmark row records it (the settings a row's speed depends on)
    cli_default: str | None = None  # what --help says of the default where the field's default is not it (e.g. "the recipe's")
    choices: tuple[str, ...] | None = None  # the values a str setting takes, where its type does not say
    flag: bool = False  # a bare option that sets True (argparse's store_true)


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, **declared: Any) -> Any:
    """A dataclass field that declares one setting (`Setting`'s fields as keywords)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"setting": Setting(**declared)})


@dataclass(frozen=True)
class Leaf:
    """One setting in a tree of groups: where it lies, its field and type, its declaration."""

    path: tuple[str, ...]  # field names from the root, e.g. ("batch", "micro_batch")
    field: dataclasses.Field
    annotation: Any
    declared: Setting
    group: str  # the title of the group it lies in (the root's own fields: "")

    @property
    def key(self) -> str:
        return self.declared.key or self.field.name

    @property
    def label(self) -> str:
        """Its name in the banner and tables: the option without dashes, else the key with dashes."""
        return self.declared.cli.removeprefix("--") if self.declared.cli else self.key.replace("_", "-")

    @property
    def converter(self) -> Callable[[str], Any]:
        """Command-line text to the setting's value (argparse's `type`: its name is in argparse's error message)."""
        if self.declared.parse is not None:
            return self.declared.parse
        kind = _plain(self.annotation)
        if kind is bool:
            return on_off
        if kind in (int, float):
            return kind
        return Path if kind is Path else str

    def choices(self) -> tuple[str, ...] | None:
        """The values the command line takes, as it spells them."""
        kind = _plain(self.annotation)
        if self.declared.choices is not None:
            return self.declared.choices
        if kind is bool and self.declared.parse is None:
            return tuple(ON_OFF)
        if get_origin(kind) is Literal:
            return tuple(get_args(kind))
        return None

    def allowed(self) -> tuple[Any, ...] | None:
        """The parsed values argparse accepts (its `choices`)."""
        choices = self.choices()
        return None if choices is None else tuple(self.converter(c) for c in choices)

    def show(self, value: Any) -> str:
        """A value as the command line spells it."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return "-" if value is None else str(value)


def _plain(annotation: Any) -> Any:
    """`X | None` -> X (the type a command-line value parses to)."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def _titles(cls: type) -> Mapping[str, str]:
    return getattr(cls, "GROUP_TITLES", {})


@cache
def leaves(root: type) -> tuple[Leaf, ...]:
    """Every setting under the dataclass `root`, in declaration order; raises when two share a key."""
    found = tuple(_walk(root, (), ""))
    keys = [leaf.key for leaf in found]
    if doubles := sorted({k for k in keys if keys.count(k) > 1}):
        raise TypeError(f"{root.__name__}: setting keys declared twice: {doubles}")
    return found


def _walk(cls: type, prefix: tuple[str, ...], group: str) -> Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        declared = field.metadata.get("setting")
        annotation = hints[field.name]
        if declared is None and dataclasses.is_dataclass(annotation):
            yield from _walk(annotation, (*prefix, field.name), _titles(cls).get(field.name, group or field.name))
        elif declared is not None:
            yield Leaf((*prefix, field.name), field, annotation, declared, group)


def value_of(obj: Any, leaf: Leaf) -> Any:
    for name in leaf.path:
        obj = getattr(obj, name)
    return obj


def with_values(obj: Any, values: Mapping[tuple[str, ...], Any]) -> Any:
    """`obj` with the settings at these paths replaced (groups rebuilt with `dataclasses.replace`)."""
    own = {path[0]: value for path, value in values.items() if len(path) == 1}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in values.items():
        if len(path) > 1:
            nested.setdefault(path[0], {})[path[1:]] = value
    for name, inner in nested.items():
        own[name] = with_values(getattr(obj, name), inner)
    return dataclasses.replace(obj, **own) if own else obj


def with_overrides(obj: Any, overrides: Mapping[str, Any]) -> Any:
    """`obj` with settings replaced by key (None values are left alone); an unknown key raises KeyError."""
    by_key = {leaf.key: leaf for leaf in leaves(type(obj))}
    if unknown := sorted(set(overrides) - set(by_key)):
        raise KeyError(f"unknown settings {unknown}; known: {', '.join(sorted(by_key))}")
    return with_values(obj, {by_key[k].path: v for k, v in overrides.items() if v is not None})


def add_options(parser: argparse.ArgumentParser, root: type, *, title: str | None = None, overrides: bool = False,
                presets: Sequence[Any] = ()) -> None:
    """One option per declared `cli` under `root`, in argparse groups by declaration group (`title`: the group of
    `root`'s own fields; None: the parser's own). Each parses to its setting's value. `overrides`: every option
    defaults to None, meaning "the recipe's own", else to its field's default. --help names the field's default and
    each of `presets` (named instances, e.g. the recipes) that sets another value."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for leaf in leaves(root):
        if leaf.declared.cli is None:
            continue
        name = leaf.group or title
        target = parser if name is None else groups.setdefault(name, parser.add_argument_group(name))
        if leaf.declared.flag:
            target.add_argument(leaf.declared.cli, dest=leaf.key, action="store_true", help=leaf.declared.help.replace("%", "%%"))
            continue
        default = None if overrides else field_default(leaf)
        target.add_argument(leaf.declared.cli, dest=leaf.key, type=leaf.converter, choices=leaf.allowed(), metavar=_metavar(leaf),
                            default=default, help=_help(leaf, presets))


def field_default(leaf: Leaf) -> Any:
    """The setting's default in its declaration (None where it has none)."""
    if leaf.field.default is not MISSING:
        return leaf.field.default
    return leaf.field.default_factory() if leaf.field.default_factory is not MISSING else None


def _metavar(leaf: Leaf) -> str | None:
    if leaf.declared.metavar:
        return leaf.declared.metavar
    choices = leaf.choices()
    return "{" + ",".join(choices) + "}" if choices else None


def _help(leaf: Leaf, presets: Sequence[Any]) -> str:
    text = leaf.declared.help.replace("%", "%%")
    if leaf.declared.cli_default is not None:
        return f"{text} (default: {leaf.declared.cli_default})"
    default = field_default(leaf)
    if default is None:
        return text
    others = [f"{getattr(p, 'name', '?')} {leaf.show(value_of(p, leaf))}" for p in presets if value_of(p, leaf) != default]
    return f"{text} (default: {leaf.show(default)}" + (f"; {', '.join(others)}" if others else "") + ")"


def overrides_from(args: argparse.Namespace, root: type) -> dict[str, Any]:
    """The settings the command line gave (key -> value); options not given are left out."""
    return {leaf.key: getattr(args, leaf.key) for leaf in leaves(root)
            if leaf.declared.cli is not None and getattr(args, leaf.key, None) is not None}


def switch_flags(obj: Any) -> list[str]:
    """The Megatron flags of the on/off switches that are on, in declaration order."""
    return [leaf.declared.megatron for leaf in leaves(type(obj)) if leaf.declared.megatron and value_of(obj, leaf)]


def settings_in(data: Mapping[str, Any], root: type, keys: Sequence[str] | None = None, source: str = "the data") -> dict[str, Any]:
    """Settings by key from `data`, `dataclasses.asdict` of a `root` (its groups nested): `keys`, or, with None, every
    setting declared `recorded`. Data without one of them raises ValueError naming `source` and the setting's path."""
    found = {}
    for leaf in leaves(root):
        if not (leaf.key in keys if keys is not None else leaf.declared.recorded):
            continue
        node: Any = data
        for part in leaf.path:
            if not isinstance(node, Mapping) or part not in node:
                raise ValueError(f"{source} has no {'.'.join(leaf.path)} (written by another version of the launcher)")
            node = node[part]
        found[leaf.key] = node
    return found


def banner_lines(obj: Any) -> list[str]:
    """One line per group: 'group: label value, ...' for every setting."""
    lines: dict[str, list[str]] = {}
    for leaf in leaves(type(obj)):
        lines.setdefault(leaf.group or "run", []).append(f"{leaf.label} {leaf.show(value_of(obj, leaf))}")
    return [f"{group}: {', '.join(items)}" for group, items in lines.items()]


def _first_clause(text: str) -> str:
    """Up to the first '; ' or '. ' outside parentheses (an abbreviation such as 'e.g.' does not end it)."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text[i:i + 2] in ("; ", ". ") and not text[:i + 1].endswith(("e.g.", "i.e.")):
            return text[:i]
    return text


def option_table(parser: argparse.ArgumentParser) -> list[str]:
    """A Markdown table of the parser's options: option, what it does (help's first sentence), default."""
    rows = ["| option | what it does | default |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        text = (action.help or "").replace("%%", "%")
        default = ""
        if text.endswith(")") and "(default: " in text:
            text, default = text.rsplit(" (default: ", 1)
            default = default[:-1]
        first = _first_clause(text)
        option = action.option_strings[-1] + (f" {action.metavar}" if action.metavar and action.nargs != 0 else "")
        rows.append(f"| `{option}` | {first.replace('|', '/')} | {default.replace('|', '/')} |")
    return rows
