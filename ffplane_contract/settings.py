"""Every ffplane command's settings, from four places: flags > environment > TOML file > defaults.

Each flag ``--budget-mb`` of ``statestore serve`` is also ``$FFPLANE_STATESTORE_BUDGET_MB`` (the
``ffplane`` command's ``--dataserver``: ``$FFPLANE_DATASERVER``) and
``budget_mb`` (or ``budget-mb``) in the ``[statestore.serve]`` table of the file named by
``--config`` or ``$FFPLANE_CONFIG``. A few settings mean the same to every process and are also
read unscoped (``$FFPLANE_DATASERVER``, ``$FFPLANE_TOKEN_FILE``, ``$FFPLANE_LOG_LEVEL``,
``$FFPLANE_LOG_FORMAT``), as the client library reads them. A file key that names no flag is an
error (a typo must not silently fall back to a default), as are a table that is no command's
(``[statestore.serv]``), a setting given twice (``budget_mb`` and ``budget-mb``), a value of the
wrong type and a file that is not UTF-8.
``--help`` shows each flag's default and its variable.

Every numeric flag's ``type=`` is a ``Number``: its range, checked where a value enters (the flag,
the variable and the file all go through it), so ``nan``, ``inf`` and a port of 99999 are refused
in one line naming their source, never found later by the server. The ranges shared by every
command are declared here once (``port``, ``positive_seconds``, ...), as is the form of a URL a
server advertises (``http_url``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ffplane_contract.limits import MAX_STEP

__all__ = [
    "CONFIG_ENV",
    "ConfigError",
    "Number",
    "command_parser",
    "env_name",
    "http_url",
    "nonneg_int",
    "nonneg_rate",
    "nonneg_seconds",
    "parse",
    "port",
    "port_or_off",
    "positive_int",
    "positive_seconds",
    "subcommand",
    "version",
]

CONFIG_ENV = "FFPLANE_CONFIG"
# Every command's table a config file may hold: one file serves them all, so a table for a command
# other than the one running is fine, and any other table is a typo (a test holds it to the parsers).
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
_SHARED = frozenset({"dataserver", "token_file", "log_level", "log_format"})  # also read unscoped
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting from the environment or the config file that cannot be used; names its source."""


class Number:
    """An argparse ``type=``: an ``int`` or a finite ``float`` in ``lo..hi`` (``above``: ``lo``
    itself excluded); anything else is an ``ArgumentTypeError`` naming the range."""

    def __init__(self, kind: type[int] | type[float], lo: float, hi: float, *, above: bool = False, unit: str = "") -> None:
        self.kind, self.lo, self.hi, self.above, self.unit = kind, lo, hi, above, unit
        self.__name__ = kind.__name__  # argparse names a type by it

    def describe(self) -> str:
        what = "an integer" if self.kind is int else f"{self.unit or 'a number'}"
        lo = f"> {self.lo:g}" if self.above else f">= {self.lo:g}"
        if self.kind is float:
            return f"{what} {lo} and <= {self.hi:g}"
        return f"{what} {lo}" if self.hi >= _INT_MAX else f"{what} in {self.lo}..{self.hi}"

    def __call__(self, raw: str) -> int | float:
        try:
            value = self.kind(raw.strip())
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {raw!r}") from None
        if not math.isfinite(value) or value < self.lo or (self.above and value == self.lo) or value > self.hi:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {raw!r}")
        return value


_INT_MAX = MAX_STEP  # a count is exact in every JSON reader, as a step is
_SECONDS_MAX = 365 * 86400.0
port = Number(int, 0, 65535)  # 0: the system picks one
port_or_off = Number(int, -1, 65535)  # -1: none
positive_int = Number(int, 1, _INT_MAX)
nonneg_int = Number(int, 0, _INT_MAX)
positive_seconds = Number(float, 0, _SECONDS_MAX, above=True, unit="seconds")
nonneg_seconds = Number(float, 0, _SECONDS_MAX, unit="seconds")
nonneg_rate = Number(float, 0, 1e9, unit="Mbit/s")


_HOST = re.compile(r"^([A-Za-z0-9_.-]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$")  # a name, an IPv4 or (between brackets) an IPv6 address
_URL_FORM = "an http:// or https:// URL with a host (and a port, else the scheme's), like http://10.0.0.1:8470"


def http_url(raw: str) -> str:
    """An argparse ``type=``: ``http(s)://HOST[:PORT]`` (a trailing ``/`` dropped), a port in
    1..65535 (none: the scheme's, as behind a load balancer), the host one others can reach (not
    0.0.0.0 or ::); anything else (no scheme, a path, a query, credentials) is an
    ``ArgumentTypeError`` naming the form."""
    text = raw.strip()
    try:
        url = urlsplit(text)
        host, port = url.hostname, url.port
    except ValueError:  # a port that is no number or out of range, a bracketed host that is no IPv6
        raise argparse.ArgumentTypeError(f"expected {_URL_FORM}, got {raw!r}") from None
    if url.scheme not in ("http", "https") or not host or not _HOST.match(host) or (port is not None and not 1 <= port <= 65535):
        raise argparse.ArgumentTypeError(f"expected {_URL_FORM}, got {raw!r}")
    if url.path not in ("", "/") or url.query or url.fragment or url.username is not None or text.endswith(("?", "#")):
        raise argparse.ArgumentTypeError(f"expected {_URL_FORM} (no path, query or credentials), got {raw!r}")
    if host in ("0.0.0.0", "::"):
        raise argparse.ArgumentTypeError(
            f"expected {_URL_FORM}, got {raw!r}: {host} is where a server listens, not an address others reach"
        )
    return text.rstrip("/")


class _Parser(argparse.ArgumentParser):
    """Refuses bad input in one line (argparse prints its usage first; ``--help`` still shows it)."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("ffplane")
    except PackageNotFoundError:
        return "0+unknown (not installed)"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The top parser of an ffplane command: ``--version``, ``--config``, defaults in ``--help``."""
    p = _Parser(prog=prog, description=description, formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--config", metavar="FILE", default=None, help=f"TOML file of settings (else ${CONFIG_ENV}); flags and environment win")
    return p


def subcommand(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows defaults like the command's."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help, formatter_class=_Formatter)
    return parser


def env_name(prog: str, dest: str) -> str:
    """``$FFPLANE_STATESTORE_BUDGET_MB`` for ``statestore``'s ``--budget-mb``; the ``ffplane``
    command's flags are ``$FFPLANE_<FLAG>``."""
    return f"FFPLANE_{'' if prog == 'ffplane' else prog.upper() + '_'}{dest.upper()}"


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the environment and the config file as defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = _config_path(argv)
    table = _load(path) if path else {}
    _check_tables(table, "", path)
    for command, sub in _commands(parser):
        section: Any = table.get(parser.prog, {})
        for part in command.split(".") if command else ():
            section = section.get(part, {}) if isinstance(section, dict) else section
        if sub is not parser and not any(a.dest == "config" for a in sub._actions):
            sub.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="TOML file of settings (see the command's --help)")
        _apply(parser.prog, command, sub, section, path)
    return parser.parse_args(argv)


def _config_path(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    found = os.environ.get(CONFIG_ENV)
    return Path(found) if found else None


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


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str | None, argparse.ArgumentParser]]:
    """(subcommand, its parser) for each subcommand (nested ones joined with '.'), or (None, parser)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(None, parser)]
    out: list[tuple[str | None, argparse.ArgumentParser]] = []
    for name, sub in subs[0].choices.items():
        for inner, leaf in _commands(sub):
            out.append((name if inner is None else f"{name}.{inner}", leaf))
    return out


def _settable(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return [a for a in sub._actions if a.option_strings and not isinstance(a, skip) and a.dest != "config"]


def _apply(prog: str, command: str | None, sub: argparse.ArgumentParser, section: Any, path: Path | None) -> None:
    where = f"config file {path} [{'.'.join(p for p in (prog, command) if p)}]"
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a table of settings")
    given: dict[str, Any] = {}
    for key, value in section.items():  # budget-mb and budget_mb are one setting: given once
        dest = key.replace("-", "_")
        if dest in given:
            spelled = sorted(k for k in section if k.replace("-", "_") == dest)
            raise ConfigError(f"{where} sets {dest} twice (as {' and '.join(map(repr, spelled))}): keep one")
        given[dest] = value
    actions = {a.dest: a for a in _settable(sub)}
    unknown = sorted(set(given) - set(actions))
    if unknown:
        raise ConfigError(f"{where} has {unknown}, which {prog} {command or ''} has no flag for; its settings: {sorted(actions)}")
    for action in sub._actions:  # a positional's range is in its help too
        if not action.option_strings and isinstance(action.type, Number) and action.help:
            action.help = f"{action.help} [{action.type.describe()}]"
    for dest, action in actions.items():
        name = env_name(prog, dest)
        names = [name] + ([f"FFPLANE_{dest.upper()}"] if dest in _SHARED else [])
        raw_env = next(((n, os.environ[n]) for n in names if os.environ.get(n)), None)
        if raw_env is not None:
            value = _convert(action, raw_env[1], f"${raw_env[0]}")
        elif dest in given:
            value = _convert(action, given[dest], f"{where} {dest}")
        else:
            value = None
        if value is not None:
            action.default = value
            action.required = False
        if action.help is not argparse.SUPPRESS:
            limits = f" [{action.type.describe()}]" if isinstance(action.type, Number) else ""
            action.help = f"{action.help or ''}{limits} [env {name}]".strip()


def _convert(action: argparse.Action, raw: Any, source: str) -> Any:
    try:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if isinstance(raw, bool):
                flag = raw
            elif str(raw).lower() in _TRUE | _FALSE:
                flag = str(raw).lower() in _TRUE
            else:
                raise ValueError(f"expected true or false, got {raw!r}")
            return flag if isinstance(action, argparse._StoreTrueAction) else not flag
        if isinstance(action, argparse._AppendAction):
            items = raw if isinstance(raw, list) else [s for s in str(raw).split(",") if s]
            return [action.type(str(i)) if action.type else i for i in items]  # type: ignore[operator]
        if isinstance(raw, (dict, list)):
            raise ValueError(f"expected a single value, got {raw!r}")
        value = action.type(str(raw)) if action.type and callable(action.type) else (str(raw) if not isinstance(raw, str) else raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{source}: {value!r} is not one of {sorted(action.choices)}")
    return value


def _check_tables(section: dict[str, Any], at: str, path: Path | None) -> None:
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
