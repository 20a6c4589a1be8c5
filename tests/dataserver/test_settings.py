"""Every command's settings: flags > environment > TOML file > defaults, errors that name their source."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dataserver.cli import _parser as dataserver_parser
from ffplane_contract.settings import ConfigError, parse, version
from ffplane_harness.cli import _parser as ffplane_parser
from statestore.cli import _parser as statestore_parser

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "dataserver": dataserver_parser,
    "statestore": statestore_parser,
    "ffplane": ffplane_parser,
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("FFPLANE_"):
            monkeypatch.delenv(k)


def _serve(argv: list[str]) -> argparse.Namespace:
    return parse(statestore_parser(), ["serve", "--dataserver", "http://10.0.0.1:8470", *argv])


def test_flags_beat_the_environment_which_beats_the_file_which_beats_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "ffplane.toml"
    config.write_text(
        "[statestore.serve]\nbudget-mb = 99\nwindow = 7\nkeep_consumed = 5\nno-replicate = true\n\n[dataserver.serve]\nport = 1\n"
    )
    monkeypatch.setenv("FFPLANE_STATESTORE_WINDOW", "6")
    monkeypatch.setenv("FFPLANE_STATESTORE_KEEP_CONSUMED", "4")
    args = _serve(["--config", str(config), "--keep-consumed", "3"])
    assert (args.keep_consumed, args.window, args.budget_mb, args.no_replicate) == (3, 6, 99, True)  # flag, env, file, file
    assert args.heartbeat_s == 1.0  # default
    monkeypatch.setenv("FFPLANE_CONFIG", str(config))  # the file named by the environment, too
    assert _serve([]).budget_mb == 99


def test_shared_settings_are_read_unscoped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FFPLANE_DATASERVER", "http://10.9.9.9:8470")
    monkeypatch.setenv("FFPLANE_TOKEN_FILE", "/run/secrets/ffplane-token")
    args = parse(statestore_parser(), ["serve"])  # --dataserver is required, and given by the environment
    assert args.dataserver == "http://10.9.9.9:8470" and args.token_file == "/run/secrets/ffplane-token"
    monkeypatch.setenv("FFPLANE_STATESTORE_DATASERVER", "http://10.1.1.1:8470")
    assert parse(statestore_parser(), ["serve"]).dataserver == "http://10.1.1.1:8470"  # the scoped one first


@pytest.mark.parametrize(
    ("env", "file", "message"),
    [
        ({"FFPLANE_STATESTORE_WINDOW": "four"}, "", r"\$FFPLANE_STATESTORE_WINDOW: expected an integer >= 1, got 'four'"),
        ({"FFPLANE_STATESTORE_NO_REPLICATE": "maybe"}, "", r"\$FFPLANE_STATESTORE_NO_REPLICATE: expected true or false"),
        ({"FFPLANE_STATESTORE_LOG_LEVEL": "verbose"}, "", r"'verbose' is not one of \['debug', 'error', 'info', 'warning'\]"),
        ({}, "[statestore.serve]\nbudget_gb = 4\n", r"has \['budget_gb'\], which statestore serve has no flag for"),
        ({}, "[statestore.serve]\nwindow = [1, 2]\n", r"window: expected a single value"),
        ({}, "[statestore.serve\n", r"is not valid TOML"),
        ({}, "[trainer]\nx = 1\n", r"\[trainer\], which is no ffplane command's; the tables are \[dataserver.ingest\]"),
        (
            {},
            "[statestore.serv]\nwindow = 1\n",
            r"\[statestore.serv\], which is no ffplane command's; the tables are .*\[statestore.serve\]",
        ),
        ({}, "[dataserver.serv]\nport = 1\n", r"\[dataserver.serv\], which is no ffplane command's"),  # another command's, mistyped
        ({}, "[ffplane.job.creat]\ndp = 1\n", r"\[ffplane.job.creat\], which is no ffplane command's"),
        ({}, "[statestore.serve.gate]\nx = 1\n", r"\[statestore.serve.gate\], which is no ffplane command's"),
        ({}, "[statestore]\nwindow = 1\n", r"\[statestore\] has \['window'\]: settings go in a command's table"),
        (
            {},
            "[statestore.serve]\nbudget_mb = 1\nbudget-mb = 2\n",
            r"\[statestore.serve\] sets budget_mb twice \(as 'budget-mb' and 'budget_mb'\)",
        ),
    ],
)
def test_a_bad_setting_names_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], file: str, message: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = []
    if file:
        (tmp_path / "c.toml").write_text(file)
        argv = ["--config", str(tmp_path / "c.toml")]
    with pytest.raises(ConfigError, match=message):
        _serve(argv)


def test_a_missing_config_file_is_an_error_the_command_reports(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "statestore", "--config", str(tmp_path / "absent.toml"), "serve", "--dataserver", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "absent.toml: No such file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_flag_has_help_with_its_default_and_variable(prog: str) -> None:
    from ffplane_contract.settings import _commands, _settable

    parser = PARSERS[prog]()
    parse(parser, _a_valid_argv(prog))
    for command, sub in _commands(parser):
        for action in _settable(sub):
            assert action.help and "[env FFPLANE_" in action.help, f"{prog} {command} {action.option_strings} has no help"
        text = sub.format_help()
        assert "(default:" in text, f"{prog} {command}: defaults not shown"


def _a_valid_argv(prog: str) -> list[str]:
    return {
        "dataserver": ["serve", "--data-dir", "."],
        "statestore": ["serve", "--dataserver", "http://127.0.0.1:9"],
        "ffplane": ["job", "list"],
    }[prog]


@pytest.mark.parametrize("module", ["dataserver", "statestore", "ffplane_harness.cli"])
def test_version_everywhere(module: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and version() in r.stdout


# --- ranges: every numeric setting has one, checked where the value enters ------------------------


def _run(module: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command run to its exit (a value it failed to refuse would leave it serving: the timeout fails the test)."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("FFPLANE_")} | {"FFPLANE_TOKEN": "test-token-0123456789"}
    return subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=20, env=base | (env or {}), cwd=cwd
    )


@pytest.mark.parametrize(
    ("module", "argv", "env", "file", "source"),
    [
        ("dataserver", ["serve", "--dead-after-s", "nan"], {}, "", "--dead-after-s"),
        ("dataserver", ["serve", "--dead-after-s", "0"], {}, "", "--dead-after-s"),
        ("dataserver", ["serve", "--port", "99999"], {}, "", "--port"),
        ("dataserver", ["serve", "--heartbeat-udp-port", "70000"], {}, "", "--heartbeat-udp-port"),
        ("dataserver", ["serve"], {"FFPLANE_DATASERVER_DEAD_AFTER_S": "inf"}, "", "$FFPLANE_DATASERVER_DEAD_AFTER_S"),
        ("dataserver", ["serve"], {}, "[dataserver.serve]\nforget-dead-after-s = nan\n", "[dataserver.serve] forget_dead_after_s"),
        ("statestore", ["serve", "--heartbeat-s", "0"], {}, "", "--heartbeat-s"),
        ("statestore", ["serve"], {"FFPLANE_STATESTORE_HEARTBEAT_S": "nan"}, "", "$FFPLANE_STATESTORE_HEARTBEAT_S"),
        ("statestore", ["serve"], {}, "[statestore.serve]\nbulk_port = 70000\n", "[statestore.serve] bulk_port"),
        ("ffplane_harness.cli", ["status", "--timeout-s", "-1"], {}, "", "--timeout-s"),
        ("ffplane_harness.cli", ["job", "create", "j", "--dataset", "d", "--dp", "0", "--batch-per-rank", "1"], {}, "", "--dp"),
    ],
)
def test_a_number_out_of_range_is_refused_in_one_line_naming_its_source(
    tmp_path: Path, module: str, argv: list[str], env: dict[str, str], file: str, source: str
) -> None:
    extra = {"dataserver": ["--data-dir", str(tmp_path)], "statestore": ["--dataserver", "http://127.0.0.1:9", "--root", str(tmp_path)]}
    argv = argv + extra.get(module, []) + (["--port", "0"] if module == "dataserver" and "--port" not in argv else [])
    if file:
        (tmp_path / "c.toml").write_text(file)
        argv = ["--config", str(tmp_path / "c.toml"), *argv]
    r = _run(module, argv, env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert source in r.stderr, r.stderr


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_numeric_setting_has_a_range_that_refuses_nan_and_inf(prog: str) -> None:
    from ffplane_contract.settings import Number, _commands

    parser = PARSERS[prog]()
    parse(parser, _a_valid_argv(prog))
    seen = 0
    for command, sub in _commands(parser):
        for action in sub._actions:
            numeric = action.type in (int, float) or (type(action.default) in (int, float) and action.choices is None)
            if numeric or isinstance(action.type, Number):
                assert isinstance(action.type, Number), f"{prog} {command} {action.dest}: no range"
                seen += 1
                for bad in ("nan", "inf", "-inf", "1e999", "", "x"):
                    with pytest.raises(argparse.ArgumentTypeError):
                        action.type(bad)
                assert f"[{action.type.describe()}]" in (action.help or ""), f"{prog} {command} {action.dest}: range not in --help"
    assert seen


def test_a_file_may_hold_every_commands_tables(tmp_path: Path) -> None:
    from ffplane_contract.settings import COMMANDS, _commands

    declared = {f"{prog}.{command}" for prog, make in PARSERS.items() for command, _ in _commands(make())}
    assert set(COMMANDS) == declared  # the tables a file may hold are the commands there are
    (tmp_path / "c.toml").write_text("\n".join(f"[{c}]" + ("\nwindow = 3" if c == "statestore.serve" else "") for c in COMMANDS))
    assert _serve(["--config", str(tmp_path / "c.toml")]).window == 3


def test_a_config_file_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_bytes(b'[statestore.serve]\nnode-id = "n\xe9"\n')
    r = _run("statestore", ["--config", str(tmp_path / "c.toml"), "serve", "--dataserver", "http://127.0.0.1:9", "--root", str(tmp_path)])
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "c.toml is not UTF-8" in r.stderr, r.stderr


_BAD_URLS = [
    "10.0.0.1:8470",  # no scheme
    "ftp://h:8470",
    "http://h:0",
    "http://h:99999",
    "http://h:port",
    "http://:8470",  # no host
    "http://0.0.0.0:8470",  # where it listens, not where it is reached
    "http://[::]:8470",
    "http://h:8470/ds",
    "http://h:8470?x=1",
    "http://user:pw@h:8470",
    "http://h x:8470",
    "",
]


@pytest.mark.parametrize("raw", _BAD_URLS)
def test_an_advertise_url_that_is_no_http_url_with_a_host_and_a_port_is_refused_in_one_line(tmp_path: Path, raw: str) -> None:
    r = _run("dataserver", ["serve", "--data-dir", str(tmp_path), "--port", "0", "--advertise-url", raw], cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--advertise-url" in r.stderr and repr(raw) in r.stderr and "http://10.0.0.1:8470" in r.stderr, r.stderr


def test_an_advertise_url_from_the_environment_or_a_file_is_checked_the_same_way(tmp_path: Path) -> None:
    argv = ["serve", "--data-dir", str(tmp_path), "--port", "0"]
    r = _run("dataserver", argv, {"FFPLANE_DATASERVER_ADVERTISE_URL": "dataserver:8470"}, cwd=tmp_path)
    assert r.returncode == 2 and "$FFPLANE_DATASERVER_ADVERTISE_URL" in r.stderr and "'dataserver:8470'" in r.stderr, r.stderr
    (tmp_path / "c.toml").write_text('[dataserver.serve]\nadvertise_url = "http://dataserver/ds"\n')
    r = _run("dataserver", ["--config", str(tmp_path / "c.toml"), *argv], cwd=tmp_path)
    assert r.returncode == 2 and "[dataserver.serve] advertise_url" in r.stderr and "'http://dataserver/ds'" in r.stderr, r.stderr


def test_a_good_advertise_url_is_taken_without_its_trailing_slash() -> None:
    def url(raw: str) -> str:
        value: str = parse(dataserver_parser(), ["serve", "--data-dir", ".", "--advertise-url", raw]).advertise_url
        return value

    assert url("http://10.0.0.1:8470/") == "http://10.0.0.1:8470"
    assert url("https://ds.example.com:443") == "https://ds.example.com:443"
    assert url("https://ds.example.com") == "https://ds.example.com"  # the scheme's port (a load balancer)
    assert url("http://[fd00::1]:8470") == "http://[fd00::1]:8470"
    assert url("http://my_dataserver:8470") == "http://my_dataserver:8470"  # a compose service name
