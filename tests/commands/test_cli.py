"""The `megamemo` dispatcher (megamemo/cli.py): a subcommand's own exit code, an unknown one named with the list,
and TorchDynamo off unless the user chose (see megamemo/kernels/compiler.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megamemo import cli


@pytest.fixture
def environ(monkeypatch):
    """The process environment as cli.main leaves it, restored afterwards; the process-wide set-up main does for a
    command's own process (warning filters, the allocator, the extensions directory) left out of the test's."""
    import os

    from megamemo.runtime import allocator, extensions, quiet

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.delenv("MEGAMEMO_SET_TORCHDYNAMO_DISABLE", raising=False)
    for module, name in (
        (quiet, "install"),
        (allocator, "tune_cpu_allocator"),
        (extensions, "use_writable_extensions_dir"),
    ):
        monkeypatch.setattr(module, name, lambda *a, **k: None)
    return os.environ


def test_a_subcommands_exit_code_is_the_commands(environ, tmp_path, capsys):
    assert cli.main(["verify-shards", str(tmp_path / "nowhere")]) == 1
    assert f"problem(s) in {tmp_path / 'nowhere'}" in capsys.readouterr().err
    assert environ["TORCHDYNAMO_DISABLE"] == environ["MEGAMEMO_SET_TORCHDYNAMO_DISABLE"] == "1"  # megamemo's own


def test_an_unknown_subcommand_is_named_with_the_list(environ, capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megamemo: unknown subcommand 'trian'") and "\n  train " in err and "\n  eval " in err
    assert cli.main([]) == 0 and capsys.readouterr().out.startswith("usage: megamemo SUBCOMMAND")


def test_the_users_torchdynamo_choice_is_kept(environ, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    cli.main(["verify-shards", str(tmp_path / "nowhere")])
    assert environ["TORCHDYNAMO_DISABLE"] == "0" and "MEGAMEMO_SET_TORCHDYNAMO_DISABLE" not in environ


def test_trains_flags_become_config_overrides():
    """`megamemo train`'s flags are --set overrides of their keys, after the --set ones (a later one wins), strings
    quoted for YAML."""
    from megamemo.commands.train import config_sets, parse_args

    args = parse_args(
        [
            "--config",
            "c.yaml",
            "--set",
            "optim.lr=1e-4",
            "--data",
            "d'x",
            "--tp",
            "2",
            "--max-steps",
            "0",
            "--set",
            "train.seed=3",
        ]
    )
    assert config_sets(args) == [
        "optim.lr=1e-4",
        "train.seed=3",
        "data.dir='d''x'",
        "train.max_steps=0",
        "parallel.tp=2",
    ]


def test_the_shared_flags_are_one_definition_the_same_on_every_machine(monkeypatch):
    """--ckpt, --data, --device, --mem-len, --dtype, --config and --set come from megamemo/commands/flags.py wherever
    a command takes them, and no parser depends on the machine: --device is "auto" until the command runs, so the
    generated CLI reference is the same with or without a GPU."""
    import argparse
    import sys

    import torch

    from megamemo.commands import flags

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import docs_reference

    seen = {}
    for name, (target, _) in cli.SUBCOMMANDS.items():
        parser = docs_reference.command_parser(target)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for p in [parser] + [q for a in subs for q in a.choices.values()]:
            for a in p._actions:
                flag = a.option_strings[0][2:] if a.option_strings else None
                # not these, other flags of the same name: plan's --device (the kind of ranks planned for),
                # prepare's --dtype (the token ids' storage), convert import-reference's --config (the reference
                # model's constructor arguments)
                if flag in flags.SHARED and (name, flag) not in (
                    ("plan", "device"),
                    ("prepare", "dtype"),
                    ("convert", "config"),
                ):
                    shared = flags.SHARED[flag]
                    assert a.metavar == shared.get("metavar") and a.type == shared.get("type"), (name, flag)
                    assert set(shared.get("choices", ())) <= set(a.choices or ()), (name, flag)
                    seen.setdefault(flag, []).append(name)
                    if flag == "device":
                        assert a.default == "auto", (name, a.default)
    assert sorted(seen["ckpt"]) == ["analyze", "convert", "convert", "eval", "export", "generate", "harness", "replay"]
    assert sorted(seen["data"]) == ["analyze", "convert", "eval", "export", "generate", "train"]
    assert sorted(seen["device"]) == ["analyze", "eval", "generate", "harness"]
    assert sorted(seen["mem-len"]) == ["analyze", "eval", "generate", "harness"]
    assert sorted(seen["dtype"]) == ["convert", "eval"] and sorted(seen["set"]) == ["plan", "train"]
    pages = []
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        pages.append(docs_reference.cli_page())
    assert pages[0] == pages[1] and "| `--device` |  | `'auto'` |" in pages[0]
