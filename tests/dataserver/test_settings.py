"""Every command's settings: flags > environment > TOML file > defaults, errors that name their source,
all derived from one declaration per setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dataserver.cli import PROGRAM as DATASERVER
from ffplane_contract.settings import ConfigError, Program, describe, env_names, settable, version
from ffplane_harness.config import PROGRAM as FFPLANE
from statestore.cli import PROGRAM as STATESTORE
from statestore.config import DaemonConfig

PROGRAMS: dict[str, Program] = {"dataserver": DATASERVER, "statestore": STATESTORE, "ffplane": FFPLANE}


def _serve(argv: list[str], env: dict[str, str] | None = None) -> DaemonConfig:
    _, cfg = STATESTORE.parse(["serve", "--dataserver", "http://10.0.0.1:8470", *argv], env or {})
    assert isinstance(cfg, DaemonConfig)
    return cfg


def test_flags_beat_the_environment_which_beats_the_file_which_beats_defaults(tmp_path: Path) -> None:
    config = tmp_path / "ffplane.toml"
    config.write_text(
        "[statestore.serve]\nbudget-mb = 99\nwindow = 7\nkeep_consumed = 5\nno-replicate = true\n\n[dataserver.serve]\nport = 1\n"
    )
    env = {"FFPLANE_STATESTORE_WINDOW": "6", "FFPLANE_STATESTORE_KEEP_CONSUMED": "4"}
    cfg = _serve(["--config", str(config), "--keep-consumed", "3"], env)
    assert (cfg.keep_consumed, cfg.window, cfg.budget_mb, cfg.no_replicate) == (3, 6, 99, True)  # flag, env, file, file
    assert cfg.heartbeat_s == 1.0 and not cfg.replicate and cfg.budget_bytes == 99 << 20  # a default; what the daemon reads
    assert _serve([], {"FFPLANE_CONFIG": str(config)}).budget_mb == 99  # the file named by the environment, too
    assert _serve(["--window", "9"], {"FFPLANE_STATESTORE_WINDOW": ""}).window == 9  # a variable set empty is not given


def test_shared_settings_are_read_unscoped() -> None:
    env = {"FFPLANE_DATASERVER": "http://10.9.9.9:8470", "FFPLANE_TOKEN_FILE": "/run/secrets/ffplane-token"}
    _, cfg = STATESTORE.parse(["serve"], env)  # --dataserver is required, and given by the environment
    assert cfg.dataserver == "http://10.9.9.9:8470" and cfg.token_file == "/run/secrets/ffplane-token"
    _, cfg = STATESTORE.parse(["serve"], env | {"FFPLANE_STATESTORE_DATASERVER": "http://10.1.1.1:8470"})
    assert cfg.dataserver == "http://10.1.1.1:8470"  # the scoped one first
    _, cfg = STATESTORE.parse(["serve"], env | {"FFPLANE_LOG_LEVEL": "debug", "FFPLANE_LOG_FORMAT": "json"})
    assert (cfg.log_level, cfg.log_format) == ("debug", "json")


def test_a_required_setting_missing_everywhere_is_named_with_its_three_sources() -> None:
    with pytest.raises(ConfigError, match=r"--dataserver is required \(or \$FFPLANE_STATESTORE_DATASERVER or \$FFPLANE_DATASERVER, or dataserver in the \[statestore.serve\] table"):  # fmt: skip
        STATESTORE.parse(["serve"], {})


@pytest.mark.parametrize(
    ("env", "file", "message"),
    [
        ({"FFPLANE_STATESTORE_WINDOW": "four"}, "", r"\$FFPLANE_STATESTORE_WINDOW: expected an integer >= 1, got 'four'"),
        ({"FFPLANE_STATESTORE_NO_REPLICATE": "maybe"}, "", r"\$FFPLANE_STATESTORE_NO_REPLICATE: expected true or false"),
        (
            {"FFPLANE_STATESTORE_LOG_LEVEL": "verbose"},
            "",
            r"\$FFPLANE_STATESTORE_LOG_LEVEL: invalid choice: 'verbose' \(choose from 'debug', 'info', 'warning', 'error'\)",
        ),
        ({}, "[statestore.serve]\nbudget_gb = 4\n", r"has \['budget_gb'\], which statestore serve has no flag for"),
        ({}, "[statestore.serve]\nwindow = [1, 2]\n", r"window: expected a single value"),
        ({}, "[statestore.serve]\nwindow = true\n", r"\[statestore.serve\] window: expected an integer >= 1, got 'true'"),
        (
            {},
            "[statestore.serve]\nheartbeat-s = inf\n",
            r"\[statestore.serve\] heartbeat_s: expected seconds >= 0.05 and <= 3600, got 'inf'",
        ),
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
        ({}, "[statestore.serve]\ndurable-every = 5\n", r"--durable-every needs --durable-dir"),  # a check across settings
    ],
)
def test_a_bad_setting_names_where_it_came_from(tmp_path: Path, env: dict[str, str], file: str, message: str) -> None:
    argv = []
    if file:
        (tmp_path / "c.toml").write_text(file)
        argv = ["--config", str(tmp_path / "c.toml")]
    with pytest.raises(ConfigError, match=message):
        _serve(argv, env)


def test_a_missing_config_file_is_an_error_the_command_reports(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "statestore", "--config", str(tmp_path / "absent.toml"), "serve", "--dataserver", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "absent.toml: No such file" in r.stderr and "Traceback" not in r.stderr


def _a_valid_argv(prog: str, path: str) -> list[str]:
    return {
        "dataserver ingest": ["ingest", "a.jsonl", "--out", "o"],
        "dataserver serve": ["serve", "--data-dir", "."],
        "statestore serve": ["serve", "--dataserver", "http://127.0.0.1:9"],
        "ffplane job create": ["job", "create", "j", "--dataset", "d", "--dp", "1", "--batch-per-rank", "1"],
        "ffplane job show": ["job", "show", "j"],
        "ffplane job delete": ["job", "delete", "j"],
        "ffplane export": ["export", "j", "3", "out"],
    }.get(f"{prog} {path}", path.split())


def _commands() -> list[tuple[str, str]]:
    return [(prog, path) for prog, program in sorted(PROGRAMS.items()) for path in program.commands]


@pytest.mark.parametrize(("prog", "path"), _commands())
def test_every_setting_has_a_flag_variable_and_help_with_its_default_and_range(prog: str, path: str) -> None:
    program = PROGRAMS[prog]
    program.parse(_a_valid_argv(prog, path), {})  # a valid command line of each command parses
    text = " ".join(program.help(path).split())  # argparse wraps lines at spaces
    assert "(default:" in text, f"{prog} {path}: defaults not shown"
    for name, info in settable(program.commands[path].settings).items():
        assert info.description, f"{prog} {path} {name} has no help"
        assert f"--{name.replace('_', '-')}" in text, f"{prog} {path}: no flag for {name}"
        assert f"[env {' or '.join(env_names(prog, name))}]" in text, f"{prog} {path} {name}: its variable is not in --help"


def test_help_shows_defaults_ranges_and_variables_as_the_command_prints_it() -> None:
    r = subprocess.run([sys.executable, "-m", "statestore", "serve", "--help"], capture_output=True, text=True, timeout=60)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "--budget-mb int shared memory this daemon may use, MiB [an integer in 1..1073741824] [env FFPLANE_STATESTORE_BUDGET_MB] (default: 4096)" in text  # fmt: skip
    assert "[env FFPLANE_STATESTORE_DATASERVER or FFPLANE_DATASERVER] (required)" in text


@pytest.mark.parametrize(("prog", "path"), _commands())
def test_every_numeric_setting_has_a_range_that_refuses_nan_inf_and_huge_values(prog: str, path: str) -> None:
    program = PROGRAMS[prog]
    text = " ".join(program.help(path).split())
    for name, info in program.commands[path].settings.model_fields.items():
        if not describe(info):
            continue
        assert f"[{describe(info)}]" in text, f"{prog} {path} {name}: range not in --help"
        if name not in settable(program.commands[path].settings):
            continue  # a positional: tried on the command line below
        argv, flag, variable = _a_valid_argv(prog, path), f"--{name.replace('_', '-')}", env_names(prog, name)[0]
        for bad in ("nan", "inf", "-inf", "1e999", "x", "-1e300", "1e300", str(10**30)):
            if flag in argv:  # a required one: its value on the command line is the bad one
                at = argv.index(flag) + 1
                with pytest.raises(ConfigError, match=rf"argument {flag}: expected"):
                    program.parse([*argv[: at - 1], f"{flag}={bad}", *argv[at + 1 :]], {})
            else:
                with pytest.raises(ConfigError, match=rf"\${variable}: expected"):
                    program.parse(argv, {variable: bad})


def test_a_positional_number_is_checked_as_a_flag_is() -> None:
    with pytest.raises(ConfigError, match=r"argument STEP: expected an integer >= 0, got '-1'"):
        FFPLANE.parse(["export", "j", "-1", "out"], {})
    with pytest.raises(ConfigError, match=r"argument STEP: expected an integer >= 0, got 'nan'"):
        FFPLANE.parse(["export", "j", "nan", "out"], {})


def test_a_file_may_hold_every_commands_tables(tmp_path: Path) -> None:
    from ffplane_contract.settings import COMMANDS

    declared = {f"{prog}.{path.replace(' ', '.')}" for prog, path in _commands()}
    assert set(COMMANDS) == declared  # the tables a file may hold are the commands there are
    (tmp_path / "c.toml").write_text("\n".join(f"[{c}]" + ("\nwindow = 3" if c == "statestore.serve" else "") for c in COMMANDS))
    assert _serve(["--config", str(tmp_path / "c.toml")]).window == 3


def test_a_positional_argument_is_a_flag_only(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[ffplane.job.show]\nname = "j"\n')
    with pytest.raises(ConfigError, match=r"has \['name'\], which ffplane job show has no flag for"):
        FFPLANE.parse(["--config", str(tmp_path / "c.toml"), "job", "show", "j"], {})


def test_lists_aliases_and_switches_from_every_source(tmp_path: Path) -> None:
    def ingest(argv: list[str], env: dict[str, str]) -> Any:
        return DATASERVER.parse(["ingest", "a.jsonl", "b.jsonl", "--out", "o", *argv], env)[1]

    assert ingest(["--binary-field", "image", "--binary-field", "mask"], {}).binary_field == ["image", "mask"]
    assert ingest([], {"FFPLANE_DATASERVER_BINARY_FIELD": "image,mask"}).binary_field == ["image", "mask"]
    (tmp_path / "c.toml").write_text('[dataserver.ingest]\nbinary-field = ["image"]\nno-progress = true\nshard_mb = 4\n')
    options = ingest(["--config", str(tmp_path / "c.toml")], {})
    assert options.binary_field == ["image"] and options.to_config().shard_bytes == 4 << 20 and not options.to_config().progress
    assert [str(p) for p in options.sources] == ["a.jsonl", "b.jsonl"]
    _, status = FFPLANE.parse(["status", "--json"], {"FFPLANE_JOB": "j1"})
    assert status.as_json and status.job == "j1"
    _, export = FFPLANE.parse(["export", "j", "3", "out", "--socket", "/run/d.sock"], {})  # the older spelling of --daemon-socket
    assert str(export.daemon_socket) == "/run/d.sock" and export.step == 3
    assert FFPLANE.parse(["export", "j", "3", "out"], {"FFPLANE_DAEMON_SOCKET": "/x.sock"})[1].daemon_socket == Path("/x.sock")


def test_the_demo_models_are_the_job_runners() -> None:
    from typing import get_args

    from ffplane_harness.config import DemoModel
    from ffplane_harness.job_runner import MODELS

    assert sorted(get_args(DemoModel)) == sorted(MODELS)


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
        value: str = DATASERVER.parse(["serve", "--data-dir", ".", "--advertise-url", raw], {})[1].advertise_url
        return value

    assert url("http://10.0.0.1:8470/") == "http://10.0.0.1:8470"
    assert url("https://ds.example.com:443") == "https://ds.example.com:443"
    assert url("https://ds.example.com") == "https://ds.example.com"  # the scheme's port (a load balancer)
    assert url("http://[fd00::1]:8470") == "http://[fd00::1]:8470"
    assert url("http://my_dataserver:8470") == "http://my_dataserver:8470"  # a compose service name
