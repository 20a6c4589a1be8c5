"""Every ffplane command's settings, declared once, read from four places: flags > environment > TOML file > defaults.

A command's settings are one pydantic model (``statestore serve``: ``statestore.config.DaemonConfig``)
whose fields each declare, once, their type, default, range and help. Everything else is derived
from that declaration: the flag ``--budget-mb`` (pydantic-settings' CLI source builds the parser
and its ``--help``), the variable ``$FFPLANE_STATESTORE_BUDGET_MB`` (the ``ffplane`` command's
``--dataserver``: ``$FFPLANE_DATASERVER``), the key ``budget_mb`` (or ``budget-mb``) in the
``[statestore.serve]`` table of the file named by ``--config`` or ``$FFPLANE_CONFIG``, and the
``--help`` line showing its default, its range and its variable. A few settings mean the same to
every process and are also read unscoped (``$FFPLANE_DATASERVER``, ``$FFPLANE_TOKEN_FILE``,
``$FFPLANE_LOG_LEVEL``, ``$FFPLANE_LOG_FORMAT``, the daemon's ``$FFPLANE_WARM_DIR``), as the client
library and the workers read them.

The three sources' values are merged (flags over variables over the file over the defaults) and
validated once, by the model: its ranges are the only range checks (``nan``, ``inf`` and a port of
99999 are refused wherever they come from). A refusal is one line naming where the value came
from (``$FFPLANE_STATESTORE_WINDOW: expected an integer >= 1, got 'four'``). A file key that names
no setting is an error (a typo must not silently fall back to a default), as are a table that is no
command's (``[statestore.serv]``), a setting given twice (``budget_mb`` and ``budget-mb``), a list
where one value goes, and a file that is not UTF-8.

Declarations are written in the terms of ``ffplane_contract.setting_types`` (the base model, the
shared ranges), re-exported here. Only a command's ``main`` calls ``Program.parse``, handing it the
environment: library code takes its settings as arguments. The choice of pydantic-settings is
recorded in docs/decisions.md ("One declaration per setting").
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, get_args, get_origin

from pydantic import BaseModel, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import CliSettingsSource

from ffplane_contract.setting_types import (
    HttpUrl,
    LogFormat,
    LogLevel,
    NonNegInt,
    NonNegSeconds,
    Port,
    PortOrOff,
    PositiveInt,
    PositiveSeconds,
    RateMbit,
    Settings,
    Unit,
    describe,
    external_name,
    http_url,
    is_positional,
    kind,
)

__all__ = [
    "COMMANDS",
    "CONFIG_ENV",
    "SHARED",
    "Command",
    "ConfigError",
    "HttpUrl",
    "LogFormat",
    "LogLevel",
    "NonNegInt",
    "NonNegSeconds",
    "Port",
    "PortOrOff",
    "PositiveInt",
    "PositiveSeconds",
    "Program",
    "RateMbit",
    "Settings",
    "Unit",
    "describe",
    "env_names",
    "http_url",
    "settable",
    "version",
]

CONFIG_ENV = "FFPLANE_CONFIG"
# Every command's table a config file may hold: one file serves them all, so a table for a command
# other than the one running is fine, and any other table is a typo (a test holds it to the programs).
COMMANDS = (
    "dataserver.ingest",
    "dataserver.serve",
    "ffplane.demo",
    "ffplane.export",
    "ffplane.job.create",
    "ffplane.job.delete",
    "ffplane.job.list",
    "ffplane.job.show",
    "ffplane.status",
    "statestore.serve",
)
SHARED = frozenset({"dataserver", "token_file", "log_level", "log_format", "warm_dir"})  # also read unscoped


class ConfigError(ValueError):
    """A setting that cannot be used, in one line naming its source (flag, variable or file)."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("ffplane")
    except PackageNotFoundError:
        return "0+unknown (not installed)"


def settable(settings: type[BaseModel]) -> dict[str, FieldInfo]:
    """The settings of ``settings`` a variable or a file may give (positional arguments are
    flags only), by their names outside."""
    return {external_name(n, i): i for n, i in settings.model_fields.items() if not is_positional(i)}


def _fields(settings: type[BaseModel]) -> dict[str, FieldInfo]:
    return {external_name(n, i): i for n, i in settings.model_fields.items()}


def env_names(prog: str, name: str) -> list[str]:
    """The variables of setting ``name`` of ``prog``, first first: ``FFPLANE_STATESTORE_BUDGET_MB``;
    the ``ffplane`` command's are ``FFPLANE_<NAME>``; a shared setting is also read unscoped."""
    scoped = f"FFPLANE_{'' if prog == 'ffplane' else prog.upper() + '_'}{name.upper()}"
    unscoped = f"FFPLANE_{name.upper()}"
    return [scoped] + ([unscoped] if name in SHARED and unscoped != scoped else [])


def _flag(name: str, info: FieldInfo) -> str:
    return name.upper() if is_positional(info) else f"--{name.replace('_', '-')}"


# --- the command line ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    """A leaf command (``serve``, ``job create``) and the model declaring its settings;
    ``shortcuts``: more spellings of a flag (``{"daemon-socket": "socket"}``)."""

    path: str
    settings: type[BaseModel]
    help: str
    shortcuts: Mapping[str, str] = field(default_factory=dict)


class _Parser(argparse.ArgumentParser):
    """Refuses bad input in one line (argparse prints its usage first; ``--help`` still shows it)."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _described(prog: str, settings: type[BaseModel]) -> type[BaseModel]:
    """``settings`` with each field's help followed by its range and variables, for ``--help``."""
    fields: dict[str, Any] = {}
    for name, info in settings.model_fields.items():
        shown = copy.copy(info)
        extra = [f"[{describe(info)}]"] if describe(info) else []
        if not is_positional(info):
            extra.append(f"[env {' or '.join(env_names(prog, external_name(name, info)))}]")
        shown.description = " ".join([info.description or "", *extra]).strip()
        fields[name] = (info.annotation, shown)
    described: type[BaseModel] = create_model(settings.__name__, __base__=BaseModel, **fields)
    return described


class Program:
    """A command (``statestore``) and its leaf commands: the parser, ``--help`` and the settings."""

    def __init__(self, prog: str, description: str, commands: Sequence[Command], groups: Mapping[str, str] | None = None) -> None:
        self.prog, self.description, self.commands = prog, description, {c.path: c for c in commands}
        self.groups = dict(groups or {})  # help of the commands that hold others ("job")

    def parser(self) -> argparse.ArgumentParser:
        """The parser: ``--version``, ``--config``, a subcommand per command, each one's flags."""
        return self._build()[0]

    def help(self, path: str) -> str:
        """``--help`` of command ``path``."""
        return self._build()[1][path].format_help()

    def parse(self, argv: Sequence[str] | None, environ: Mapping[str, str]) -> tuple[str, Any]:
        """(the command's path, its settings) from ``argv`` (default ``sys.argv[1:]``), ``environ``
        and the config file; a ``ConfigError`` naming the source of a setting that cannot be used.
        Bad usage and ``--help`` exit as argparse does (2, 0)."""
        root, _, sources = self._build()
        ns = root.parse_args(list(sys.argv[1:] if argv is None else argv))
        words, depth = [], 0
        while getattr(ns, f"_command{depth}", None):
            words.append(getattr(ns, f"_command{depth}"))
            depth += 1
        path = " ".join(words)
        command = self.commands[path]
        found = getattr(ns, "config", None) or environ.get(CONFIG_ENV)
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        if found:
            config = Path(found)
            _merge(values, origins, _from_file(self.prog, path, command, _table(_load(config), self.prog, path, config), config))
        _merge(values, origins, _from_env(self.prog, command, environ))
        fields = _fields(command.settings)
        cli = sources[path](parsed_args=ns)()
        _merge(values, origins, {k: (v, f"argument {_flag(k, fields[k])}") for k, v in cli.items() if k in fields})
        try:
            return path, command.settings.model_validate(values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, self.prog, path, command, origins)) from None

    def _build(self) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser], dict[str, CliSettingsSource[Any]]]:
        root = _Parser(prog=self.prog, description=self.description, formatter_class=argparse.RawDescriptionHelpFormatter)
        root.add_argument("--version", action="version", version=f"%(prog)s {version()}")
        root.add_argument("--config", metavar="FILE", default=None, help=f"TOML file of settings (else ${CONFIG_ENV}); flags and environment win")  # fmt: skip
        parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {(): root}
        subs: dict[tuple[str, ...], Any] = {}
        leaves: dict[str, argparse.ArgumentParser] = {}
        sources: dict[str, CliSettingsSource[Any]] = {}
        for path, command in self.commands.items():
            words = tuple(path.split())
            for depth in range(1, len(words) + 1):
                at = words[:depth]
                if at in parsers:
                    continue
                if at[:-1] not in subs:
                    subs[at[:-1]] = parsers[at[:-1]].add_subparsers(dest=f"_command{depth - 1}", required=True, metavar="COMMAND")
                text = command.help if depth == len(words) else self.groups.get(" ".join(at), "")
                parsers[at] = subs[at[:-1]].add_parser(at[-1], help=text, description=text, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
            leaves[path] = leaf = parsers[words]
            leaf.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=f"TOML file of settings (else ${CONFIG_ENV})")
            sources[path] = CliSettingsSource(
                cast(Any, _described(self.prog, command.settings)),
                root_parser=leaf,
                cli_kebab_case=True,
                cli_implicit_flags="toggle",  # a bool defaulting to False is --flag; one defaulting to True, --no-flag
                cli_hide_none_type=True,
                cli_avoid_json=True,
                cli_shortcuts=dict(command.shortcuts),
            )
        return root, leaves, sources


def _merge(values: dict[str, Any], origins: dict[str, str], given: Mapping[str, tuple[Any, str]]) -> None:
    for name, (value, origin) in given.items():
        values[name], origins[name] = value, origin


def _from_env(prog: str, command: Command, environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for name, info in settable(command.settings).items():
        var = next((v for v in env_names(prog, name) if environ.get(v)), None)  # set but empty: not given
        if var is not None:
            raw = environ[var]
            out[name] = ([s for s in raw.split(",") if s] if get_origin(kind(info)) is list else raw, f"${var}")
    return out


# --- the config file -------------------------------------------------------------------------------
def _load(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); TOML files are UTF-8") from exc


def _table(document: dict[str, Any], prog: str, path: str, config: Path) -> dict[str, Any]:
    """The running command's table of the file, once every table is checked to be a command's."""
    _check_tables(document, "", config)
    section: Any = document
    for part in [prog, *path.split()]:
        section = section.get(part, {}) if isinstance(section, dict) else section
    if not isinstance(section, dict):
        raise ConfigError(f"config file {config} [{prog}.{'.'.join(path.split())}] must be a table of settings")
    return section


def _from_file(prog: str, path: str, command: Command, table: dict[str, Any], config: Path) -> dict[str, tuple[Any, str]]:
    where = f"config file {config} [{prog}.{'.'.join(path.split())}]"
    given: dict[str, Any] = {}
    for key, value in table.items():  # budget-mb and budget_mb are one setting: given once
        name = key.replace("-", "_")
        if name in given:
            spelled = sorted(k for k in table if k.replace("-", "_") == name)
            raise ConfigError(f"{where} sets {name} twice (as {' and '.join(map(repr, spelled))}): keep one")
        given[name] = value
    known = settable(command.settings)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"{where} has {unknown}, which {prog} {path} has no flag for; its settings: {sorted(known)}")
    return {name: (_file_value(known[name], value, f"{where} {name}"), f"{where} {name}") for name, value in given.items()}


def _file_value(info: FieldInfo, value: Any, source: str) -> Any:
    """A file's value as the text a flag would have given (``true`` is no integer, as on the command line)."""
    if get_origin(kind(info)) is list:
        items = value if isinstance(value, list) else [s for s in str(value).split(",") if s]
        return [str(i) for i in items]
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{source}: expected a single value, got {value!r}")
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_tables(section: dict[str, Any], at: str, path: Path) -> None:
    """Every table of the file is a command's (``COMMANDS``) or on the way to one, and settings are
    only in commands' tables: ``[statestore.serv]`` must not be silently read as nothing."""
    for key, value in section.items():
        name = f"{at}.{key}" if at else key
        if isinstance(value, dict):
            if not any(c == name or c.startswith(name + ".") for c in COMMANDS):
                known = ", ".join(f"[{c}]" for c in COMMANDS)
                raise ConfigError(f"config file {path} has [{name}], which is no ffplane command's; the tables are {known}")
            _check_tables(value, name, path)
        elif at not in COMMANDS:
            settings = sorted(k for k, v in section.items() if not isinstance(v, dict))
            where = f"[{at}]" if at else "its top level"
            tables = ", ".join(f"[{c}]" for c in COMMANDS if not at or c.startswith(at + "."))
            raise ConfigError(f"config file {path} {where} has {settings}: settings go in a command's table ({tables})")


# --- refusals --------------------------------------------------------------------------------------
_NUMERIC = ("int_", "float_", "greater_than", "less_than", "finite_number")


def _explain(exc: ValidationError, prog: str, path: str, command: Command, origins: Mapping[str, str]) -> str:
    """The first error of ``exc`` in one line, naming where the value came from."""
    err = exc.errors(include_url=False)[0]
    if not err["loc"]:  # a check across settings: its message names them
        return str(err.get("ctx", {}).get("error", err["msg"]))
    name = str(err["loc"][0])
    info = _fields(command.settings)[name]
    if err["type"] == "missing":
        if is_positional(info):
            return f"{prog} {path}: the argument {name.upper()} is required"
        variables = " or ".join(f"${v}" for v in env_names(prog, name))
        return f"{prog} {path}: {_flag(name, info)} is required (or {variables}, or {name} in the [{prog}.{'.'.join(path.split())}] table of --config)"  # fmt: skip
    given = err["input"]
    if err["type"] == "literal_error":
        reason = f"invalid choice: {given!r} (choose from {', '.join(map(repr, get_args(kind(info))))})"  # argparse's words
    elif err["type"].startswith("bool_"):
        reason = f"expected true or false, got {given!r}"
    elif err["type"] == "value_error":
        reason = str(err.get("ctx", {}).get("error", err["msg"]))
    elif len(err["loc"]) == 1 and err["type"].startswith(_NUMERIC) and describe(info):
        reason = f"expected {describe(info)}, got {given!r}"
    else:
        reason = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {given!r}"
    return f"{origins.get(name, f'the default of {name}')}: {reason}"
