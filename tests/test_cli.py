"""The `megamemo` dispatcher (megamemo/cli.py): a subcommand's own exit code, an unknown one named with the list,
and TorchDynamo off unless the user chose (see megamemo/kernels/compiler.py)."""
from __future__ import annotations

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
    for module, name in ((quiet, "install"), (allocator, "tune_cpu_allocator"),
                         (extensions, "use_writable_extensions_dir")):
        monkeypatch.setattr(module, name, lambda *a, **k: None)
    return os.environ


def test_a_subcommands_exit_code_is_the_commands(environ, tmp_path, capsys):
    assert cli.main(["verify-shards", str(tmp_path / "nowhere")]) == 1
    assert f"problem(s) in {tmp_path / 'nowhere'}" in capsys.readouterr().err
    assert environ["TORCHDYNAMO_DISABLE"] == environ["MEGAMEMO_SET_TORCHDYNAMO_DISABLE"] == "1"   # megamemo's own


def test_an_unknown_subcommand_is_named_with_the_list(environ, capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megamemo: unknown subcommand 'trian'") and "\n  train " in err and "\n  eval " in err
    assert cli.main([]) == 0 and capsys.readouterr().out.startswith("usage: megamemo SUBCOMMAND")


def test_the_users_torchdynamo_choice_is_kept(environ, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    cli.main(["verify-shards", str(tmp_path / "nowhere")])
    assert environ["TORCHDYNAMO_DISABLE"] == "0" and "MEGAMEMO_SET_TORCHDYNAMO_DISABLE" not in environ
