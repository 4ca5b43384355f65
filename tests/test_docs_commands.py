"""Every command in the `bash` blocks of README.md and docs/guide/*.md still parses.

`dsv-jax SUB ...` and `python -m dsv_jax SUB ...`: the CLI's own parser (`dsv_jax.cli.build_parser` and
`parse_args`), then, for `train` and `fit-cost`, the config loader on the `--config` and `key=value` overrides:
everything the CLI checks before it starts work, and nothing trains. A `--config FILE.yaml` that a `yaml` block of
the docs defines (first line `# FILE.yaml`) is loaded from that block; a run's `config.json` is checked as the
`tiny` preset (the overrides' keys and types are the same in every preset).

`python -m experiments.NAME ...`: experiments/NAME.py must exist, and its own argparse must accept the arguments.
One subprocess runs every such script as `__main__` with the documented arguments and stops each right after its
parser returns (this test imports no experiments module itself). A script without an argument parser may appear
only without arguments: it would run whole.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from dsv_jax import cli
from dsv_jax.config import PRESETS, ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "guide")
DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(GUIDE, f) for f in os.listdir(GUIDE) if f.endswith(".md")
)

# Deliberately broken commands, each with what the checker must say about it: proves that it bites.
BROKEN = {
    "dsv-jax train --config tiny --no-such-flag": "unrecognized arguments: --no-such-flag",
    "dsv-jax trian --config tiny": "invalid choice: 'trian'",
    "python -m dsv_jax train --config tiny model.no_such_key=8": "model.no_such_key",
    "dsv-jax train --config tiny-motoin": "unknown preset 'tiny-motoin'",
    "dsv-jax sample --model runs/tiny --out clip.gif --weights best": "invalid choice: 'best'",
    "python -m experiments.bench_e2e --only 64k/full --no-such-flag": "unrecognized arguments: --no-such-flag",
    "python -m experiments.no_such_script": "no experiments/no_such_script.py",
    "python -m experiments.cp_plans --quick": "has no argument parser",
}

CONTROL = {"&&", "||", ";", "|", "&"}
REDIRECT = {">", ">>", "<"}


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined."""
    return block.replace("\\\n", " ").splitlines()


def segments(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at && ; | and friends, redirections dropped)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out, cur, skip = [], [], False
    for tok in lex:
        if skip:
            skip = False
        elif tok in CONTROL:
            out.append(cur)
            cur = []
        elif tok in REDIRECT:
            skip = True
        else:
            cur.append(tok)
    return [c for c in out + [cur] if c]


def classify(tokens: list[str]) -> tuple[str, str | None, list[str]] | None:
    """("cli", None, argv) | ("experiments", NAME, argv) | None (not a command this test checks)."""
    for i, tok in enumerate(tokens):
        if tok == "dsv-jax":
            return "cli", None, tokens[i + 1 :]
        if os.path.basename(tok) in ("python", "python3") and tokens[i + 1 : i + 2] == ["-m"] and len(tokens) > i + 2:
            module = tokens[i + 2]
            if module == "dsv_jax":
                return "cli", None, tokens[i + 3 :]
            if module.startswith("experiments."):
                return "experiments", module.split(".", 1)[1], tokens[i + 3 :]
    return None


def documented_commands() -> list[tuple[str, str]]:
    """(document, command line) of every checked command in the docs' bash blocks."""
    found = []
    for doc in DOCS:
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        for block in fenced(text, "bash"):
            for line in command_lines(block):
                for seg in segments(line):
                    if classify(seg):
                        found.append((os.path.relpath(doc, ROOT), shlex.join(seg)))
    return found


def config_files(tmp_dir: str) -> dict[str, str]:
    """The docs' `yaml` blocks that name their file (first line `# NAME.yaml`), written to tmp_dir."""
    files = {}
    for doc in DOCS:
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        for block in fenced(text, "yaml"):
            m = re.match(r"#\s*(\S+\.ya?ml)\s*\n", block)
            if m:
                path = os.path.join(tmp_dir, os.path.basename(m.group(1)))
                with open(path, "w", encoding="utf-8") as f:
                    f.write(block)
                files[m.group(1)] = path
    return files


def check_cli(argv: list[str], files: dict[str, str]) -> str | None:
    """None, or why the CLI would refuse argv before starting work."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = cli.parse_args(cli.build_parser(), argv)
    except SystemExit as e:
        return err.getvalue().strip() or f"exit status {e.code}"
    if args.command in ("train", "fit-cost"):
        overrides = list(args.overrides)
        if args.command == "train" and args.steps is not None:
            overrides.append(f"train.steps={args.steps}")
        if args.command == "train" and args.init_from is not None:
            overrides.append(f"train.init_from={args.init_from}")
        # train without --config builds on tiny, or on an export's config (--init-from): checked as tiny
        config = files.get(args.config, args.config) or "tiny"
        if config not in PRESETS and not os.path.isfile(config) and os.path.basename(config) == "config.json":
            config = "tiny"  # a run's resolved config: check the overrides on a preset
        try:
            load_config(config, overrides)
        except ConfigError as e:
            return str(e)
    if args.command == "presets" and args.show and args.show not in PRESETS:
        return f"presets --show {args.show}: no such preset"
    return None


# Runs experiments/NAME.py as __main__ for each (NAME, argv) on stdin and stops it once its outermost
# argparse call returns; prints {NAME argv: error or null} as JSON.
DRIVER = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

depth = 0

def stop_after(method):
    def parse(self, *args, **kwargs):
        global depth
        depth += 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            depth -= 1
        if depth == 0:
            raise Parsed
        return result
    return parse

for name in ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"):
    setattr(argparse.ArgumentParser, name, stop_after(getattr(argparse.ArgumentParser, name)))

out = {}
for key, name, argv in json.load(sys.stdin):
    err = io.StringIO()
    sys.argv = [name, *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module("experiments." + name, run_name="__main__", alter_sys=True)
        out[key] = "ran to the end without parsing its arguments"
    except Parsed:
        out[key] = None
    except SystemExit as e:
        out[key] = None if e.code in (0, None) else (err.getvalue().strip() or f"exit status {e.code}")
    except BaseException as e:
        out[key] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def check_experiments(commands: dict[str, tuple[str, list[str]]]) -> dict[str, str | None]:
    """{command: None or its error} for `python -m experiments.NAME argv` commands."""
    results, jobs = {}, []
    for key, (name, argv) in commands.items():
        path = os.path.join(ROOT, "experiments", f"{name}.py")
        if not os.path.isfile(path):
            results[key] = f"no experiments/{name}.py"
            continue
        with open(path, encoding="utf-8") as f:
            has_parser = "ArgumentParser" in f.read()
        if not has_parser:
            results[key] = None if not argv else f"experiments/{name}.py has no argument parser: {argv} are ignored"
            continue
        jobs.append((key, name, argv))
    if jobs:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER],
            input=json.dumps(jobs),
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """{command line: None or why it fails} for every documented command and every BROKEN one."""
    files = config_files(str(tmp_path_factory.mktemp("configs")))
    lines = [line for _, line in documented_commands()] + list(BROKEN)
    results, experiments = {}, {}
    for line in dict.fromkeys(lines):
        kind, name, argv = classify(shlex.split(line))
        if kind == "cli":
            results[line] = check_cli(argv, files)
        else:
            experiments[line] = (name, argv)
    results.update(check_experiments(experiments))
    return results


def test_the_docs_have_commands_to_check():
    commands = documented_commands()
    kinds = [classify(shlex.split(line))[0] for _, line in commands]
    assert kinds.count("cli") >= 25 and kinds.count("experiments") >= 8, commands
    docs = {doc for doc, _ in commands}
    assert "README.md" in docs and len(docs) >= 8  # the README and most guide pages hold commands
    assert ("README.md", "dsv-jax train --config tiny --workdir runs/tiny") in commands  # the install command's run


def test_every_documented_command_parses(checked):
    failures = [f"{doc}: {line}\n    {checked[line]}" for doc, line in documented_commands() if checked[line]]
    assert not failures, "\n".join(failures)


def test_the_checker_rejects_broken_commands(checked):
    for line, expected in BROKEN.items():
        assert checked[line] is not None, f"{line!r} passed the check"
        assert expected in checked[line], (line, checked[line])


def test_shell_lines_split_into_commands():
    line = "python3 -m venv .venv && . .venv/bin/activate && dsv-jax presets --show 2.7b > my_run.yaml  # yaml"
    assert [classify(s) for s in segments(line)] == [None, None, ("cli", None, ["presets", "--show", "2.7b"])]
    assert segments("srun -N 4 dsv-jax train --config 30b \\\n  parallel.context=16".replace("\\\n", " ")) == [
        ["srun", "-N", "4", "dsv-jax", "train", "--config", "30b", "parallel.context=16"]
    ]
    # the requeue recipes of training.md: a `#SBATCH` comment line, `; status=$?`, an until-loop
    assert segments("#SBATCH --requeue --signal=TERM@120  # SIGTERM") == []
    train = ("cli", None, ["train", "--config", "tiny"])
    assert [classify(s) for s in segments("srun dsv-jax train --config tiny; status=$?")] == [train, None]
    until = "until dsv-jax train --config tiny; do [ $? -eq 143 ] || break; done"
    assert [classify(s) for s in segments(until)] == [train, None, None, None]


# the options through which a command writes (or trains into) a file or folder
WRITES = ("workdir", "out", "output", "json", "gif")


def test_the_readme_writes_under_runs_which_git_ignores():
    """A reader who pastes the README's commands in the checkout leaves nothing that `git status` shows."""
    written = []
    for doc, line in documented_commands():
        kind, _, argv = classify(shlex.split(line))
        if doc != "README.md" or kind != "cli":
            continue
        args = cli.parse_args(cli.build_parser(), argv)
        for dest in WRITES:
            value = getattr(args, dest, None)
            written += [(line, v) for v in (value if isinstance(value, list) else [value]) if v is not None]
    assert any(dest.endswith(".gif") for _, dest in written)  # the sample, at least
    outside = [(line, path) for line, path in written if not os.path.normpath(path).startswith("runs" + os.sep)]
    assert not outside, outside
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        assert "runs/" in f.read().split()
