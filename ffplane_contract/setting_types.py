"""The vocabulary a command's settings are declared in (``ffplane_contract.settings`` derives the
flags, variables, file keys and ``--help`` from a declaration): the base model, the ranges every
command shares (``Port``, ``PositiveSeconds``...), the form of a URL a server advertises
(``HttpUrl``), and what a declared field says about itself (``describe``: its range in words)."""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_settings import CliPositionalArg

from ffplane_contract.limits import MAX_STEP

__all__ = [
    "HttpUrl",
    "LogFormat",
    "LogLevel",
    "NonNegInt",
    "NonNegSeconds",
    "Port",
    "PortOrOff",
    "PositiveInt",
    "PositiveSeconds",
    "RateMbit",
    "Settings",
    "Unit",
    "describe",
    "external_name",
    "http_url",
    "is_positional",
    "kind",
]


class Unit(NamedTuple):
    """A float setting's unit, named with its range in ``--help`` and in refusals."""

    name: str


# --- the ranges every command shares -------------------------------------------------------------
_INT_MAX = MAX_STEP  # a count is exact in every JSON reader, as a step is
_SECONDS_MAX = 365 * 86400.0
Port = Annotated[int, Field(ge=0, le=65535)]  # 0: the system picks one
PortOrOff = Annotated[int, Field(ge=-1, le=65535)]  # -1: none
PositiveInt = Annotated[int, Field(ge=1, le=_INT_MAX)]
NonNegInt = Annotated[int, Field(ge=0, le=_INT_MAX)]
PositiveSeconds = Annotated[float, Field(gt=0, le=_SECONDS_MAX), Unit("seconds")]
NonNegSeconds = Annotated[float, Field(ge=0, le=_SECONDS_MAX), Unit("seconds")]
RateMbit = Annotated[float, Field(ge=0, le=1e9), Unit("Mbit/s")]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "text", "json"]  # auto: text on a terminal, JSON lines otherwise

_HOST = re.compile(r"^([A-Za-z0-9_.-]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$")  # a name, an IPv4 or (between brackets) an IPv6 address
_URL_FORM = "an http:// or https:// URL with a host (and a port, else the scheme's), like http://10.0.0.1:8470"


def http_url(raw: str) -> str:
    """``http(s)://HOST[:PORT]`` (a trailing ``/`` dropped), a port in 1..65535 (none: the
    scheme's, as behind a load balancer), the host one others can reach (not 0.0.0.0 or ::);
    anything else (no scheme, a path, a query, credentials) is a ValueError naming the form."""
    text = raw.strip()
    try:
        url = urlsplit(text)
        host, port = url.hostname, url.port
    except ValueError:  # a port that is no number or out of range, a bracketed host that is no IPv6
        raise ValueError(f"expected {_URL_FORM}, got {raw!r}") from None
    if url.scheme not in ("http", "https") or not host or not _HOST.match(host) or (port is not None and not 1 <= port <= 65535):
        raise ValueError(f"expected {_URL_FORM}, got {raw!r}")
    if url.path not in ("", "/") or url.query or url.fragment or url.username is not None or text.endswith(("?", "#")):
        raise ValueError(f"expected {_URL_FORM} (no path, query or credentials), got {raw!r}")
    if host in ("0.0.0.0", "::"):
        raise ValueError(f"expected {_URL_FORM}, got {raw!r}: {host} is where a server listens, not an address others reach")
    return text.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(http_url)]


class Settings(BaseModel):
    """A command's settings: each field one setting (type, default, range, ``description`` = help).
    Unknown names are refused and no float is ``nan`` or infinite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --- what a declaration says about a setting -------------------------------------------------------
_POSITIONAL = get_args(CliPositionalArg[int])[1]  # the marker CliPositionalArg puts in a field's metadata


def is_positional(info: FieldInfo) -> bool:
    return _POSITIONAL in info.metadata


def external_name(name: str, info: FieldInfo) -> str:
    """The setting's name outside: the field's, or its alias (``as_json`` is ``--json``)."""
    return info.validation_alias if isinstance(info.validation_alias, str) else name


def kind(info: FieldInfo) -> Any:
    """The annotation without ``| None``."""
    annotation = info.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
    return annotation


def _bounds(info: FieldInfo) -> tuple[float | None, float | None, bool]:
    lo: float | None = None
    hi: float | None = None
    above = False
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        if getattr(m, "gt", None) is not None:
            lo, above = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
        if getattr(m, "lt", None) is not None:
            hi = m.lt - 1 if kind(info) is int else m.lt
    return lo, hi, above


def describe(info: FieldInfo) -> str:
    """A numeric setting's range in words (``an integer in 1..256``, ``seconds > 0 and <= 3600``);
    '' for any other setting."""
    number = kind(info)
    if number not in (int, float):
        return ""
    lo, hi, above = _bounds(info)
    unit = next((m.name for m in info.metadata if isinstance(m, Unit)), "")
    what = "an integer" if number is int else unit or "a number"
    low = "" if lo is None else (f"> {lo:g}" if above else f">= {lo:g}")
    if number is float:
        return " and ".join(p for p in (f"{what} {low}".strip(), "" if hi is None else f"<= {hi:g}") if p)
    if hi is None or hi >= _INT_MAX:
        return f"{what} {low}".strip()
    return f"{what} in {lo}..{hi}"
