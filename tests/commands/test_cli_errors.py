"""One error root, caught once (megamemo/cli.py run_command): a user error (a MegamemoError, or an OSError) is one
line `megamemo COMMAND: error: ...` and exit 2; anything else is a bug, shown with its traceback, exit 1. And the
flags made from a library request type (megamemo/commands/flags.py add_fields) are its fields, typed, defaulted and
explained as the fields are."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

from megamemo import cli
from megamemo.commands import flags
from megamemo.util.errors import MegamemoError, UsageError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def quiet_process(monkeypatch):
    """cli.main's process-wide set-up (warning filters, the allocator, the extensions directory) left out."""
    from megamemo.runtime import allocator, extensions, quiet

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    for module, name in (
        (quiet, "install"),
        (allocator, "tune_cpu_allocator"),
        (extensions, "use_writable_extensions_dir"),
    ):
        monkeypatch.setattr(module, name, lambda *a, **k: None)


@pytest.mark.parametrize(
    "bug", [RuntimeError("a bug deep in plot"), ValueError("a bug deep in plot"), KeyError("a bug deep in plot")]
)
def test_a_bug_in_a_command_exits_1_with_its_traceback(quiet_process, monkeypatch, capsys, bug):
    """Not a user error: a plain ValueError too (commands used to catch it, printing a bug as bad input)."""
    from megamemo.commands import plot

    def broken(argv):
        raise bug

    monkeypatch.setattr(plot, "main", broken)
    assert cli.main(["plot", "run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in broken" in err, err
    assert err.rstrip().endswith(f"{type(bug).__name__}: {bug}") and "megamemo plot: error" not in err


def test_trainings_exceptions_keep_their_own_exit_codes(quiet_process, monkeypatch, capsys):
    """train/run.py reports what training anticipates (exit 2) itself; an error that escapes it is a crash, exit 1,
    which a launcher may retry - not made a user error (exit 2, never retried) by the dispatcher."""
    from megamemo.commands import train
    from megamemo.runtime import signals

    def escaped(argv):
        raise UsageError("an error training did not anticipate")

    monkeypatch.setattr(train, "main", escaped)
    monkeypatch.setattr(signals, "hold", lambda: None)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "megamemo train: error" not in err, err


def test_a_user_error_exits_2_in_one_line(quiet_process, tmp_path, capsys):
    """The real command: a run directory without metrics.jsonl is a PlotError, a MegamemoError."""
    (tmp_path / "run").mkdir()
    assert cli.main(["plot", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megamemo plot: error: ") and str(tmp_path / "run") in lines[0]


@pytest.mark.parametrize(
    "error",
    [
        MegamemoError("bad input named"),
        UsageError("--flag: bad value named"),
        FileNotFoundError(2, "No such file or directory", "/no/such/file"),
    ],
)
def test_every_user_error_is_one_line_and_exit_2(capsys, error):
    def command(argv):
        raise error

    assert cli.run_command("eval", command, []) == 2
    assert capsys.readouterr().err == f"megamemo eval: error: {error}\n"


def test_the_projects_user_errors_derive_from_the_root():
    """A user error of every layer is caught by the dispatcher; they stay what they were (ValueError, RuntimeError)
    for the code that catches those."""
    from megamemo.checkpoint.single import SingleCheckpointError
    from megamemo.checkpoint.store import CheckpointError
    from megamemo.config.run import ConfigError
    from megamemo.data import ManifestError, ShardError
    from megamemo.eval.plot import PlotError
    from megamemo.runtime.device import DeviceError
    from megamemo.train.replay import ReplayError

    for kind in (
        ConfigError,
        ManifestError,
        ShardError,
        SingleCheckpointError,
        CheckpointError,
        PlotError,
        DeviceError,
        ReplayError,
        UsageError,
    ):
        assert issubclass(kind, MegamemoError), kind
    assert issubclass(ConfigError, ValueError) and issubclass(CheckpointError, RuntimeError)


# ---- flags from a request type ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Toy:
    path: str  # where it is
    count: int = 3  # how many
    scale: float | None = None  # by how much
    keep: bool = False  # keep it
    same: bool | None = None  # the same lengths (no: all of them; default: neither)
    ratios: list[float] | None = None  # the ratios,
    # comma-separated


@dataclasses.dataclass
class Listed:
    name: str  # the name
    # the files, one or more
    files: list[str]


def test_a_comment_block_above_a_field_is_its_own_not_the_previous_fields():
    p = argparse.ArgumentParser(prog="listed")
    flags.add_fields(p, Listed)
    helps = {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
    assert (helps["--name"], helps["--files"]) == ("the name", "the files, one or more")
    assert flags.field_values(p.parse_args(["--name", "n", "--files", "a", "b"]), Listed) == {
        "name": "n",
        "files": ["a", "b"],
    }


def toy_parser(**specs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    flags.add_fields(p, Toy, **specs)
    return p


def test_a_fields_flag_has_its_type_default_and_comment():
    p = toy_parser(count={"choices": (1, 3, 5)})
    assert Toy(**flags.field_values(p.parse_args(["--path", "p"]), Toy)) == Toy("p")
    a = p.parse_args(["--path", "p", "--count", "5", "--scale", "0.5", "--keep", "--no-same", "--ratios", "1,2.5"])
    assert Toy(**flags.field_values(a, Toy)) == Toy("p", 5, 0.5, True, False, [1.0, 2.5])
    assert p.parse_args(["--path", "p", "--same"]).same is True
    helps = {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
    assert helps["--ratios"] == "the ratios, comma-separated" and helps["--same"].startswith("the same lengths")
    for bad in (
        [],
        ["--path", "p", "--count", "2"],
        ["--path", "p", "--count", "x"],
        ["--path", "p", "--ratios", "1,x"],
    ):
        with pytest.raises(SystemExit) as e:
            p.parse_args(bad)
        assert e.value.code == 2, bad


def test_a_field_without_a_comment_has_no_flag():
    @dataclasses.dataclass
    class Unsaid:
        said: int = 1  # said
        unsaid: int = 2

    with pytest.raises(TypeError, match="Unsaid.unsaid: no comment"):
        flags.add_fields(argparse.ArgumentParser(), Unsaid)


@pytest.mark.parametrize(
    "target, request_type, own",
    [
        ("megamemo.commands.eval:main", "megamemo.eval.evaluate:Request", {"ckpt", "json", "plot", "table"}),
        ("megamemo.commands.plan:main", "megamemo.plan.report:Ask", {"config", "vocab", "set"}),
        ("megamemo.commands.generate:main", "megamemo.eval.generate:Request", {"ckpt", "out", "json"}),
    ],
)
def test_a_commands_flags_are_its_request_types_fields(target, request_type, own):
    """Beside its own few flags, a command's flags are exactly its request type's fields, and parse into it."""
    import importlib

    sys.path.insert(0, str(REPO / "scripts"))
    import docs_reference

    module, name = request_type.split(":")
    cls = getattr(importlib.import_module(module), name)
    parser = docs_reference.command_parser(target)
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests - own == {f.name for f in dataclasses.fields(cls)}
    required = {a.dest for a in parser._actions if a.required} - own
    assert required == {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
