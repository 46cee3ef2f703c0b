"""The documentation (docs/, an MkDocs site; README.md): the generated references are what the code says now, the
site builds with `mkdocs build --strict` (no broken link, no page outside the navigation, every API docstring
found), and every `megamemo` flag, config key and repository path the pages name exists."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fixture_data import REPO

sys.path.insert(0, str(REPO / "scripts"))
import docs_reference

PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
SECTIONS = ("model", "data", "optim", "precision", "parallel", "train", "checkpoint", "log", "eval")
FILE_SUFFIXES = {
    "safetensors",
    "sbatch",
    "yaml",
    "json",
    "jsonl",
    "py",
    "sh",
    "md",
    "log",
    "pt",
    "bin",
    "txt",
    "png",
    "tsv",
}  # model.safetensors, train.sbatch: files, not keys


def test_the_generated_references_are_the_codes(capsys):
    assert docs_reference.main(["--check"]) == 0, capsys.readouterr().err


def test_the_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    r = subprocess.run(
        [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def config_keys() -> set[str]:
    from megamemo.model import ModelConfig
    from megamemo.train.config import SECTIONS as CONFIG_SECTIONS

    return {
        f"{name}.{f.name}"
        for name, cls in [("model", ModelConfig), *CONFIG_SECTIONS.items()]
        for f in dataclasses.fields(cls)
    }


def _code_spans(text: str) -> list[str]:
    spans = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [line for block in spans for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", text)


def test_every_flag_key_and_path_the_pages_name_exists():
    flags = docs_reference.cli_flags()
    keys = config_keys()
    bad = []
    for page in PAGES:
        rel = page.relative_to(REPO)
        for span in _code_spans(page.read_text()):
            for m in re.finditer(r"(?<![\w-])megamemo ([a-z][a-z-]*)(?: ([a-z][\w-]*))?([^|;&]*)", span):
                sub = f"{m.group(1)} {m.group(2)}"
                cmd = sub if m.group(2) and sub in flags else m.group(1)
                if cmd not in flags:
                    if m.group(1) in flags or m.group(1) in ("train.cli", "prepare.py"):
                        continue
                    bad.append(f"{rel}: no subcommand `megamemo {m.group(1)}`")
                    continue
                known = flags[cmd] | flags.get(m.group(1), set())
                for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(3)):
                    if flag not in known and flag != "--help":
                        bad.append(f"{rel}: `megamemo {cmd}` has no flag {flag}")
            for key in re.findall(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})\.[a-z_]+)(?=[=`\s:,)]|$)", span):
                if key not in keys and key.rsplit(".", 1)[1] not in FILE_SUFFIXES:
                    bad.append(f"{rel}: no config key {key}")
            for path in re.findall(
                r"(?<![\w./-])((?:megamemo|launch|scripts|bench|tests|configs|"
                r"docs)/[\w./-]*\w)",
                span,
            ):
                if not (REPO / path).exists() and not (REPO / path.split("::")[0]).exists():
                    bad.append(f"{rel}: no file {path}")
    assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize(
    "needle", ["megamemo train --config x.yaml --no-such-flag 1", "`train.no_such_key`", "`megamemo/no/such/file.py`"]
)
def test_the_name_check_catches_a_wrong_name(tmp_path, monkeypatch, needle):
    page = tmp_path / "page.md"
    page.write_text(f"text\n\n```\n{needle}\n```\n" if needle.startswith("megamemo train") else f"see {needle}\n")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    monkeypatch.setattr(page.__class__, "relative_to", lambda self, other: self.name, raising=False)
    with pytest.raises(AssertionError):
        test_every_flag_key_and_path_the_pages_name_exists()
