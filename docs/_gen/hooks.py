"""MkDocs hooks (mkdocs.yml ``hooks:``): the pages made from the code at build time, never
committed as text, and the repository links of the hand-written pages.

* ``reference/config.md``: every key of ``jaxaccel/config.py``'s ``BASE`` with its default, its
  type (what ``config._check_type`` accepts), its rules (the checks of
  ``jaxaccel/config_checks.py``, read from its syntax tree) and its comment (read from the
  source's comments);
* ``reference/cli.md``: every command and flag of ``jaxaccel/cli.py``'s argument parser, and the
  flags of each ``jaxaccel bench`` suite (``bench/SUITE.py``'s ``add_argument`` calls);
* ``index.md``: README.md itself, its ``docs/`` links made site links.

A link of a hand-written page that leaves ``docs/`` (``../bench/results/x.json``) is kept as the
repository path in code type, and a path that does not exist in the repository fails the
build, as MkDocs' own check fails on a broken link between pages.

``python docs/_gen/hooks.py config|cli`` prints a generated page.
"""
from __future__ import annotations

import argparse
import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_PY = os.path.join(ROOT, "jaxaccel", "config.py")
CHECKS_PY = os.path.join(ROOT, "jaxaccel", "config_checks.py")
BENCH = os.path.join(ROOT, "bench")
GENERATED_NOTE = ("<!-- generated at build time by docs/_gen/hooks.py from {src}; edit the code, "
                  "not this page -->\n")


def _import_root():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


# ---- the config reference ----

def config_comments(path: str = CONFIG_PY) -> dict[str, str]:
    """{dotted key: its comment} of ``BASE`` in config.py: the comment on the key's line and the
    comment-only lines under it, joined."""
    with open(path) as f:
        source = f.read()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    start = next(i for i, t in enumerate(tokens) if t.type == tokenize.NAME and t.string == "BASE"
                 and t.start[1] == 0)
    start = next(i for i in range(start, len(tokens)) if tokens[i].string == "{")
    path_, comments, last, depth = [], {}, None, 0
    significant = [t for t in tokens[start:] if t.type not in (tokenize.NL, tokenize.NEWLINE)]
    for i, tok in enumerate(significant):
        if tok.type == tokenize.OP and tok.string == "{":
            depth += 1
            if depth > 1:
                path_.append(last.rsplit(".", 1)[-1])
        elif tok.type == tokenize.OP and tok.string == "}":
            depth -= 1
            if depth == 0:
                break
            path_.pop()
        elif (tok.type == tokenize.STRING and i + 1 < len(significant)
              and significant[i + 1].string == ":"):
            last = ".".join(path_ + [ast.literal_eval(tok.string)])
            comments[last] = ""
        elif tok.type == tokenize.COMMENT and last is not None:
            text = tok.string.lstrip("#").strip()
            comments[last] = f"{comments[last]} {text}".strip()
    return comments


def _render(node) -> str:
    """An error message's text, its formatted values shown as ``…``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    raise ValueError(f"config_checks.py line {node.lineno}: an error message that is not a "
                     "string; docs/_gen/hooks.py reads only string messages")


def _literal_keys(node) -> list[str] | None:
    """The keys of a dict display or of ``{f"data.{key}": ... for key in ("a", "b")}``."""
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys]
    if isinstance(node, ast.DictComp) and isinstance(node.key, ast.JoinedStr):
        prefix = "".join(v.value for v in node.key.values if isinstance(v, ast.Constant))
        return [prefix + e.value for e in node.generators[0].iter.elts]
    return None


def config_rules(path: str = CHECKS_PY) -> dict[str, list[str]]:
    """{dotted key (or section): [its rules]} read from config_checks.py's syntax tree: each
    ``_at_least`` bound, and each ``raise ValueError`` under an ``if`` whose test (or loop)
    reads the key. A raise that names no key fails: the reference misses no rule."""
    from jaxaccel.config import BASE
    with open(path) as f:
        tree = ast.parse(f.read())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    sections = {}                                  # (function, parameter) -> section ("" = top)
    for call in ast.walk(funcs["validate"]):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            params = [a.arg for a in funcs[call.func.id].args.args]
            for param, arg in zip(params, call.args):
                sections[(call.func.id, param)] = arg.attr if isinstance(arg, ast.Attribute) else ""
    rules: dict[str, list[str]] = {}

    def add(key, rule):
        rules.setdefault(key, [])
        if rule not in rules[key]:
            rules[key].append(rule)

    def key_of(section, attr):
        node = BASE[section] if section else BASE
        if attr in node:
            return f"{section}.{attr}" if section else attr
        return section or None                    # mesh.values(): a rule of the section

    for name, func in funcs.items():
        if name == "validate" or name == "_at_least":
            continue
        params = {p: s for (f, p), s in sections.items() if f == name}
        local_dicts = {}
        for node in ast.walk(func):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                local_dicts[node.targets[0].id] = [k.value for k in node.value.keys]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "_at_least"):
                keys = _literal_keys(node.args[0])
                low = ast.unparse(node.args[1])
                meaning = {}
                if len(node.args) > 2 and isinstance(node.args[2], ast.Dict):
                    meaning = {k.value: v.value for k, v in zip(node.args[2].keys,
                                                                node.args[2].values)}
                for key in keys:
                    add(key, f">= {low}" + (f" ({meaning[key]})" if key in meaning else ""))
        loops = {}                                 # an If inside a for loop -> the loop's keys
        for loop in ast.walk(func):
            if isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call):
                target = loop.iter.func.value if isinstance(loop.iter.func, ast.Attribute) else None
                if isinstance(target, ast.Name) and target.id in local_dicts:
                    keys = local_dicts[target.id]
                elif isinstance(target, ast.Name) and target.id in params:
                    section = params[target.id]
                    keys = [f"{section}.{k}" for k in BASE[section]]
                else:
                    continue
                for inner in ast.walk(loop):
                    loops[id(inner)] = keys
        for node in ast.walk(func):
            if not isinstance(node, ast.If):
                continue
            raises = [s for s in node.body if isinstance(s, ast.Raise)]
            if not raises:
                continue
            message = _render(raises[0].exc.args[0])
            keys = list(loops.get(id(node), []))
            for a in ast.walk(node.test):
                if (isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
                        and a.value.id in params):
                    key = key_of(params[a.value.id], a.attr)
                    if key and key not in keys:
                        keys.append(key)
            if not keys:
                raise ValueError(f"config_checks.py line {node.lineno}: a rule that reads no "
                                 "config key the reference knows; teach docs/_gen/hooks.py")
            for key in keys:
                shown = re.sub(r"^[\w.…]+=…(:\s*|\s+(?=must))", "", message)
                add(key, shown)
    return rules


def _type_of(default) -> str:
    if default is None:
        return "any (None: the default the comment names)"
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, float):
        return "float (an int is taken)"
    return type(default).__name__


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_reference() -> str:
    _import_root()
    from jaxaccel.config import BASE
    comments, rules = config_comments(), config_rules()
    out = [GENERATED_NOTE.format(src="jaxaccel/config.py and jaxaccel/config_checks.py"),
           "# Config keys\n",
           "Every key of the base config (`BASE` in `jaxaccel/config.py`), made from the code when "
           "the site is built. Set any of them in a config file's `get_config()` or with "
           "`--set KEY=VALUE`; unknown keys fail with close matches, a value of another type is "
           "refused (the *type* column), and the *rules* are checked on every config before "
           "anything is built (`jaxaccel/config_checks.py`). Which names a choice takes (an "
           "optimizer, a policy, a kernel) is checked when the run is resolved, by the part "
           "that owns the choice: the comment lists them.\n"]

    def table(section, node):
        rows = ["| key | default | type | rules | comment |", "|---|---|---|---|---|"]
        for key, default in node.items():
            if isinstance(default, dict):
                continue
            dotted = f"{section}.{key}" if section else key
            rows.append(f"| `{dotted}` | `{default!r}` | {_type_of(default)} | "
                        f"{_cell('; '.join(rules.get(dotted, [])))} | "
                        f"{_cell(comments.get(dotted, ''))} |")
        return "\n".join(rows) + "\n"

    out.append("## Top level\n")
    out.append(table("", BASE))
    for section, node in BASE.items():
        if not isinstance(node, dict):
            continue
        out.append(f"## `{section}`\n")
        if comments.get(section):
            out.append(comments[section] + "\n")
        if rules.get(section):
            out.append("Rules: " + "; ".join(rules[section]) + "\n")
        out.append(table(section, node))
    return "\n".join(out)


# ---- the CLI reference ----

def _sub_parsers(parser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            return {name: (sp, helps.get(name)) for name, sp in action.choices.items()}
    return {}


def _arguments(parser) -> list[str]:
    rows = ["| argument | takes | default | help |", "|---|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
        if a.choices:
            takes = " \\| ".join(f"`{c}`" for c in a.choices)
        elif a.nargs == 0:
            takes = "flag"
        else:
            takes = a.metavar or (a.type.__name__ if isinstance(a.type, type) else "")
            takes = takes or "text"
            if a.nargs in ("*", "+", argparse.REMAINDER):
                takes += " ..."
            if a.nargs == "?":
                takes += " (optional)"
            if isinstance(a, argparse._AppendAction):
                takes += ", repeatable"
        default = "" if a.default in (None, False, [], argparse.SUPPRESS) else f"`{a.default}`"
        if a.required and a.nargs not in ("*", "?"):
            default = "required"
        rows.append(f"| {name} | {takes} | {default} | {_cell(a.help or '')} |")
    return rows


def bench_flags(suite: str) -> list[tuple[str, str]]:
    """(option strings, help) of ``bench/SUITE.py``'s ``add_argument`` calls (and of
    ``bench/common.py``'s ``add_out_argument`` where the script calls it), read without
    importing the script."""
    path = os.path.join(BENCH, suite + ".py")
    with open(path) as f:
        tree = ast.parse(f.read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"]
    if any(isinstance(n, ast.Call) and "add_out_argument" in ast.unparse(n.func)
           for n in ast.walk(tree)):
        with open(os.path.join(BENCH, "common.py")) as f:
            common = ast.parse(f.read())
        func = next(n for n in common.body if isinstance(n, ast.FunctionDef)
                    and n.name == "add_out_argument")
        calls += [n for n in ast.walk(func) if isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"]
    flags = []
    for call in calls:
        names = [a.value for a in call.args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str)]
        help_ = next((k.value for k in call.keywords if k.arg == "help"), None)
        try:
            text = _render(help_) if help_ is not None else ""
        except ValueError:
            text = ""
        if names:
            flags.append((", ".join(f"`{n}`" for n in names), text))
    return flags


def cli_reference() -> str:
    _import_root()
    os.environ["COLUMNS"] = "100"
    from jaxaccel import cli
    parser = cli._parser()
    out = [GENERATED_NOTE.format(src="jaxaccel/cli.py's argument parser and bench/*.py"),
           "# Command line\n",
           "Every `jaxaccel` command and flag, made from the argument parser "
           "(`jaxaccel/cli.py`) when the site is built; `jaxaccel COMMAND --help` prints the "
           "same. From the module's docstring:\n",
           "```text\n" + cli.__doc__.strip() + "\n```\n"]

    def command(name, sp, help_, level):
        out.append(f"{'#' * level} `{name}`\n")
        if help_:
            out.append(help_[0].upper() + help_[1:] + ".\n")
        if sp.description and sp.description != help_:
            out.append(sp.description + "\n")
        out.append("```text\n" + sp.format_usage().strip() + "\n```\n")
        out.append("\n".join(_arguments(sp)) + "\n")
        for child, (csp, chelp) in _sub_parsers(sp).items():
            command(f"{name} {child}", csp, chelp, level + 1)

    for name, (sp, help_) in _sub_parsers(parser).items():
        command(f"jaxaccel {name}", sp, help_, 2)
        if name == "bench":
            out.append("### The suites' own flags\n")
            out.append("`jaxaccel bench SUITE FLAGS` runs `bench/SUITE.py FLAGS` "
                       "(a source checkout); each suite's flags, read from its script:\n")
            for suite in cli.BENCH_SUITES:
                out.append(f"#### `jaxaccel bench {suite}`\n")
                rows = ["| flag | help |", "|---|---|"]
                rows += [f"| {n} | {_cell(h)} |" for n, h in bench_flags(suite)]
                out.append("\n".join(rows) + "\n")
    return "\n".join(out)


# ---- links and the front page ----

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def repository_links(markdown: str, page_dir: str, docs_dir: str, where: str) -> str:
    """Links that leave ``docs/`` made the repository path in code type; a path that does not
    exist fails (ValueError)."""
    def fix(m):
        bang, text, target = m.groups()
        if re.match(r"^[a-z]+:|^#|^/", target):
            return m.group(0)
        path = os.path.normpath(os.path.join(page_dir, target.split("#")[0]))
        if path.startswith(os.path.abspath(docs_dir) + os.sep):
            return m.group(0)
        if not os.path.exists(path):
            raise ValueError(f"{where}: the link {target!r} names {path}, which does not exist")
        rel = os.path.relpath(path, ROOT)
        return f"{text} (`{rel}`)" if text and text.strip("`") != rel else f"`{rel}`"
    return _LINK.sub(fix, markdown)


def front_page() -> str:
    """README.md as the site's first page (its links are made site links by
    ``on_page_markdown``)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


# ---- the MkDocs events ----

GENERATED = {"reference/config.md": config_reference, "reference/cli.md": cli_reference,
             "index.md": front_page}


def on_files(files, config):
    from mkdocs.structure.files import File
    for uri, make in GENERATED.items():
        if files.get_file_from_path(uri) is not None:
            raise ValueError(f"docs/{uri} is generated at build time: remove the file")
        files.append(File.generated(config, uri, content=make()))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "index.md":               # README.md: links from the root
        markdown = repository_links(markdown, ROOT, config["docs_dir"], "README.md")
        return _LINK.sub(lambda m: m.group(0).replace("](docs/", "]("), markdown)
    page_dir = os.path.dirname(os.path.join(config["docs_dir"], page.file.src_uri))
    return repository_links(markdown, page_dir, config["docs_dir"], page.file.src_uri)


if __name__ == "__main__":
    print({"config": config_reference, "cli": cli_reference}[sys.argv[1]]())
