"""Command-line flags read from the settings dataclasses (vLLM's ``arg_utils`` pattern).

A settings field (``modeld/settings.py``) made with :func:`setting` carries its flag: the name,
the parser of its value, a metavar, choices and the help group. The help text is the field's
docstring and the default is the dataclass default, so adding a setting touches one field:
:func:`add_flags` puts it on ``modeld serve`` (and ``modeld describe``) and :func:`from_flags`
builds the dataclass back from the parsed flags, keeping the default of every flag not given.

The value parsers read sizes and durations the way people write them (``512M``, ``2.5m``);
a bad value is an :class:`argparse.ArgumentTypeError`, one line (blueprint 0006).

What not: checks that span fields (``--kv-pool-tokens`` needs ``--kv-unified``): ``modeld
serve`` makes them where it assembles the options (``cli.serve_options``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "Flag",
    "add_flags",
    "count",
    "field_docs",
    "field_group",
    "flag_name",
    "flag_of",
    "from_flags",
    "given",
    "parse_duration",
    "parse_positive_size",
    "parse_size",
    "setting",
]

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_FLAG_CHARS = 64
"""A flag value is at most this long (an input limit of the command line, blueprint 0006)."""


def parse_size(text: str) -> int:
    """A byte count: ``4096``, ``512M``, ``8G``, ``1.5G`` (K, M, G, T are powers of 1024; a
    trailing ``i``/``iB``/``B`` is accepted), ``0`` (off), ``auto`` (-1: the default)."""
    raw = text.strip()
    if raw.lower() == "auto":
        return -1
    body = raw.upper().removesuffix("B").removesuffix("I")
    number, unit = (body[:-1], body[-1]) if body and body[-1] in "KMGT" else (body, "")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not number or value < 0 or value != value or len(raw) > MAX_FLAG_CHARS:
        raise argparse.ArgumentTypeError(
            f"invalid size {raw[:MAX_FLAG_CHARS]!r}: give bytes with an optional K, M, G or T suffix "
            "(512M, 8G), 0 for off, or auto"
        )
    size = value * _SIZE_UNITS[unit]
    if size >= 1 << 60:
        raise argparse.ArgumentTypeError(f"size {raw!r} is too large")
    return int(size)


def parse_duration(text: str) -> float:
    """Seconds: ``90``, ``90s``, ``2.5m``, ``1h``, ``50ms``; ``0`` switches a timeout off."""
    raw = text.strip()
    unit = next((u for u in ("ms", "s", "m", "h") if raw.lower().endswith(u)), "")
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not number or value < 0 or value != value or value == float("inf") or len(raw) > MAX_FLAG_CHARS:
        raise argparse.ArgumentTypeError(
            f"invalid duration {raw[:MAX_FLAG_CHARS]!r}: give seconds, or a number with ms, s, m or h (90, 2.5m, 1h, 50ms)"
        )
    return value * _DURATION_UNITS[unit]


def parse_positive_size(text: str) -> int:
    """A byte count that must be above 0 (a limit)."""
    size = parse_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text[:MAX_FLAG_CHARS]!r}: give a size above 0 (512K, 16M)")
    return size


def count(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text[:MAX_FLAG_CHARS]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range ({low} to {high})")
        return value

    parse.__name__ = "number"
    return parse


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one settings field is set from the command line."""

    name: str
    """The option, ``--sequences``; a bool field that is on by default also gets ``--no-...``."""
    group: str
    """The ``--help`` group it is listed under."""
    parse: Callable[[str], Any] | None = None
    """The value's parser (None: the text itself, or on/off for a bool)."""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    repeat: bool = False
    """Given once per value (``--model A=a --model B=b``); the field is a tuple of them."""


def setting(
    default: Any,
    flag: str,
    group: str,
    parse: Callable[[str], Any] | None = None,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] = (),
    repeat: bool = False,
) -> Any:
    """A settings field with its default and its flag (the help is the field's docstring)."""
    if metavar is None and parse is not None:
        metavars: dict[Callable[[str], Any], str] = {
            parse_size: "SIZE",
            parse_positive_size: "SIZE",
            parse_duration: "DURATION",
        }
        metavar = metavars.get(parse, "N")
    flag_ = Flag(flag, group, parse, metavar, choices, repeat)
    return dataclasses.field(default=default, metadata={"flag": flag_})


def flag_of(f: dataclasses.Field[Any]) -> Flag:
    flag = f.metadata.get("flag")
    if not isinstance(flag, Flag):
        raise TypeError(f"settings field {f.name!r} has no flag (make it with flags.setting)")
    return flag


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), whitespace folded."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def field_group(cls: type, name: str) -> str:
    """The ``--help`` group of field ``name``'s flag."""
    return flag_of(_field(cls, name)).group


def flag_name(cls: type, name: str) -> str:
    """The option that sets field ``name`` (``--queue-wait`` for ``Limits.model_wait_seconds``)."""
    return flag_of(_field(cls, name)).name


def _dest(cls: type, name: str) -> str:
    return f"{cls.__name__.lower()}.{name}"


def _shown(value: Any, flag: Flag) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if flag.parse in (parse_size, parse_positive_size):
        if value < 0:
            return "auto"
        unit = next((u for u in "TGMK" if value and value % _SIZE_UNITS[u] == 0), "")
        return f"{value // _SIZE_UNITS[unit]}{unit}" if unit else str(value)
    if flag.parse is parse_duration:
        return f"{value:g}s" if value else "0: off"
    if isinstance(value, tuple):
        return ", ".join(value) if value else "none"
    return str(value) if value != "" else "none"


Groups = dict[str, Any]
"""``--help`` groups by title, shared by several :func:`add_flags` calls."""


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    groups: Groups | None = None,
    *,
    only: Iterable[str] | None = None,
    help: str | None = None,
) -> Groups:
    """One flag per field of the settings dataclass ``cls`` (``only``: these fields), each in its
    group, defaulting to None so that :func:`from_flags` keeps the dataclass default. ``help``
    replaces every field's own (and the groups). Returns the groups, to add more to them."""
    docs = field_docs(cls)
    groups = {} if groups is None else groups
    wanted = set(only) if only is not None else None
    for f in dataclasses.fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        flag = flag_of(f)
        text = help or f"{docs.get(f.name, '').replace('``', '')} (default {_shown(f.default, flag)})"
        where: Any = parser
        if help is None:
            where = groups.get(flag.group) or groups.setdefault(
                flag.group, parser.add_argument_group(flag.group)
            )
        kw: dict[str, Any] = {"dest": _dest(cls, f.name), "default": None, "help": text.replace("%", "%%")}
        if isinstance(f.default, bool):  # a switch that is off by default has no --no-...
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            where.add_argument(flag.name, action=action, **kw)
        elif flag.repeat:
            where.add_argument(
                flag.name, action="append", type=flag.parse, metavar=flag.metavar or "TEXT", **kw
            )
        elif flag.choices:
            where.add_argument(flag.name, choices=flag.choices, **kw)
        else:
            where.add_argument(flag.name, type=flag.parse, metavar=flag.metavar or "TEXT", **kw)
    return groups


def given(args: argparse.Namespace, cls: type, name: str) -> Any:
    """The value of field ``name``'s flag, None when the flag was not given."""
    return getattr(args, _dest(cls, name), None)


def from_flags(args: argparse.Namespace, cls: type[Any]) -> Any:
    """``cls()`` with every field whose flag was given set from it."""
    values = {f.name: given(args, cls, f.name) for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if v is not None})
