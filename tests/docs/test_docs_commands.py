"""The documented commands as a new user runs them, word for word from the pages: the README's cluster quick start
against the fake Slurm of test_launch_sbatch_args.py (the re-submission resumes in the same run directory, which
step 5 converts; `plan` prices the precision the preset trains with), and every page's commands that run on the
CPU in seconds (`megamemo plan`, `--help`, and the blocks marked `<!-- docs-test: runs -->`), run as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers.fixture_data import REPO
from test_launch_sbatch_args import batch, stubs, train_args  # noqa: F401 (stubs: a fixture)


def fenced_commands(page: Path, heading: str) -> list[str]:
    """The commands of the first fenced block after `heading` on `page`: continuation lines joined, comments and
    blank lines dropped."""
    text = page.read_text()
    start = text.index(heading)
    block = re.search(r"```[^\n]*\n(.*?)```", text[start:], flags=re.S).group(1)
    block = block.replace("\\\n", " ")
    return [
        line.split(" #")[0].strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def option(words: list[str], name: str) -> str | None:
    return next((words[i + 1] for i, w in enumerate(words[:-1]) if w == name), None)


QUICK_START = fenced_commands(REPO / "README.md", "## Quick start on a cluster")


def test_the_readme_cluster_quick_start_resubmission_resumes_where_step_5_converts(stubs):  # noqa: F811
    """Each sbatch line run by the batch script as Slurm would, each as a new job (a new job id): every submission
    trains in one run directory, the one step 5 converts."""
    submissions = [shlex.split(c) for c in QUICK_START if c.startswith("sbatch ")]
    assert len(submissions) == 2, QUICK_START
    run_dirs = []
    for job_id, words in enumerate(submissions, start=1):
        script = next(w for w in words if w.endswith(".sbatch"))
        args = words[words.index(script) + 1 :]
        rc, out, srun, _ = batch(
            stubs, Path(script).name, *args, SLURM_JOB_ID=str(1000 + job_id), MEGAMEMO_GPU_PROBE="echo 8"
        )
        assert rc == 0, out
        run_dirs.append(option(train_args(srun), "--run-dir"))
    convert = next(shlex.split(c) for c in QUICK_START if c.startswith("megamemo convert to-single"))
    assert run_dirs[0] == run_dirs[1] == option(convert, "--ckpt"), (run_dirs, convert)


def test_the_readme_cluster_quick_start_plans_the_precision_the_job_trains_with(stubs, capsys):  # noqa: F811
    """`plan` prices the config under its --set overrides; the job trains the config under the preset's
    precision (and the sbatch line's --set): the two must be one precision."""
    from megamemo.commands import plan
    from megamemo.train.config import load

    words = next(shlex.split(c) for c in QUICK_START if c.startswith("megamemo plan "))
    assert plan.main(words[2:]) == 0
    planned = re.search(r"; (fp32|bf16|fp16)$", capsys.readouterr().out.splitlines()[0]).group(1)
    submit = next(shlex.split(c) for c in QUICK_START if c.startswith("sbatch "))
    script = next(w for w in submit if w.endswith(".sbatch"))
    rc, out, srun, _ = batch(stubs, Path(script).name, *submit[submit.index(script) + 1 :], MEGAMEMO_GPU_PROBE="echo 8")
    assert rc == 0, out
    trained = train_args(srun)
    assert option(trained, "--config") == option(words, "--config")
    overrides = [trained[i + 1] for i, w in enumerate(trained[:-1]) if w == "--set"]
    dtype = load(REPO / option(trained, "--config"), overrides, vocab_fallback=32000).precision.dtype  # no data here
    assert planned == dtype, f"plan prices {planned}, the job trains {dtype}"


def test_the_tiny_run_writes_only_where_git_ignores():
    """getting-started.md's first tiny run: every file a command writes (--out, --json, --run-dir, a `>` redirect)
    lies under a directory .gitignore lists, not in the repository's root (issue 50)."""
    ignored = {
        line.strip().strip("/") for line in (REPO / ".gitignore").read_text().splitlines() if line.strip().endswith("/")
    }
    page = REPO / "docs" / "getting-started.md"
    commands = fenced_commands(page, "## A first tiny run") + fenced_commands(
        page, "**Convert, evaluate, sample, plot.**"
    )
    written = []
    for command in commands:
        words = shlex.split(command)
        written += [option(words, flag) for flag in ("--out", "--json", "--run-dir") if option(words, flag)]
        written += [words[i + 1] for i, w in enumerate(words[:-1]) if w == ">"]
    assert len(written) >= 7, commands
    outside = [w for w in written if Path(w).parts[0] not in ignored]
    assert not outside, f"written where git sees them: {outside}"


# ---- every page's quick commands, run as written ------------------------------------------------------------------
MARK = "<!-- docs-test: runs -->"  # before a fenced block: every `megamemo` line of it runs in this test


def page_commands(page: Path) -> list[tuple[int, str, bool]]:
    """(line number, command, marked) of every `megamemo ...` line of every fenced block of `page` (continuations
    joined, comments dropped); marked: the block follows MARK."""
    text, out = page.read_text(), []
    for m in re.finditer(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        marked = text[: m.start()].rstrip().endswith(MARK)
        first = text[: m.start()].count("\n") + 2
        for k, line in enumerate(m.group(1).replace("\\\n", " \n").splitlines()):
            command = line.split(" #")[0].strip()
            if command.startswith("megamemo "):
                out.append((first + k, re.sub(r"\s+", " ", command), marked))
    return out


def quick(command: str, marked: bool) -> bool:
    """What runs here in seconds on the CPU: `megamemo plan` (no data: auto vocabularies assume --vocab), any
    `--help`, and every command of a marked block."""
    words = command.split()
    return marked or words[1] in ("plan", "--help", "-h") or "--help" in words


DOC_PAGES = sorted(p for p in (REPO / "docs").rglob("*.md") if "reference" not in p.parts) + [REPO / "README.md"]
QUICK = [
    (f"{p.relative_to(REPO)}:{line}", c) for p in DOC_PAGES for line, c, marked in page_commands(p) if quick(c, marked)
]


def test_the_docs_test_finds_the_pages_quick_commands():
    pages = {where.split(":")[0] for where, _ in QUICK}
    assert {"README.md", "docs/parallelism.md", "docs/getting-started.md"} <= pages, QUICK
    assert len(QUICK) >= 7


@pytest.mark.parametrize("where, command", QUICK, ids=[w for w, _ in QUICK])
def test_every_quick_documented_command_runs_as_written(where, command, monkeypatch, capsys):
    """A page cannot drift from the CLI: each command runs from the repository's root as the page writes it, and
    none is refused as usage or config (exit code 2) or raises. plan's exit code 1 (the layout does not fit) is an
    answer, not an error."""
    from megamemo.cli import main

    monkeypatch.chdir(REPO)
    rc = main(shlex.split(command)[1:])
    captured = capsys.readouterr()
    assert rc in (0, 1) and (rc == 0 or command.startswith("megamemo plan ")), (where, rc, captured.err[-2000:])
