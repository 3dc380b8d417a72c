"""The README and docs/ name only things that exist: config keys, CLI commands and options,
metric names, modules, repository paths and local links.

Every check reads the Markdown as text and compares what it names with the code (the pydantic
config tree, the argparse parser, the metric names in the metrics modules, the files on disk),
so a renamed key, command, metric or module fails here with the file that still names the old
one. A checker that found nothing would pass vacuously, so each test also asserts that it saw
a plausible number of names, and `test_the_checkers_catch_a_renamed_name` feeds each checker a
wrong name."""

from __future__ import annotations

import re
import textwrap
import tomllib
from functools import cache
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel

from rollout_recovery.cli import build_parser
from rollout_recovery.config import RolloutRecoveryConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rollout_recovery"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Keys the docs show on purpose as wrong: the typo in the "unknown key" error example.
WRONG_ON_PURPOSE = {"vllm_cfg.dtyp"}
# Files the docs name that are the reader's, not the repository's.
READERS_FILES = {"my_env.py"}
# Hosts an http URL in the docs may name: local servers and placeholders, never another site.
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "HOST"}
FILE_EXTENSIONS = {"py", "sh", "md", "yaml", "yml", "json", "jsonl", "toml", "arrow", "txt"}
REPO_ROOTS = ("rollout_recovery", "scripts", "docs", "configs", "functional_tests", "tests", ".ci")

FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
INLINE = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # not across a blank line
# A dotted name not glued to a word, a dot, a slash or a `<placeholder>` on either side.
DOTTED = re.compile(r"(?<![\w./<-])([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/-])")
METRIC = re.compile(r"(?<![\w./])(rollout_recovery_[a-z0-9_]*[a-z0-9])(?![\w*])")
COMMAND = re.compile(r"(?:^|(?<=[\s`/(|]))rollout-recovery[ \t]+([^\n`#;|]*)")
ROOTED_PATH = re.compile(
    r"(?<![\w./<>$~-])((?:" + "|".join(re.escape(r) for r in REPO_ROOTS) + r")/[\w./*-]*[\w/*])"
)
RELATIVE_PATH = re.compile(r"(?<![\w./<>$~-])([a-z_]\w*(?:/[\w.-]+)+\.(?:py|sh|md))(?![\w/])")
BARE_MODULE = re.compile(r"(?<![\w./<>$~-])([a-z_]\w*\.py)(?![\w/])")
FROM_IMPORT = re.compile(
    r"^[ \t]*from[ \t]+(rollout_recovery[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w \t,]+))", re.M
)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
URL = re.compile(r"(?:https?|ftp)://([^/\s`)\]>:]+)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def text(path: Path) -> str:
    return path.read_text()


def fences(doc: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return [(m.group(1), textwrap.dedent(m.group(2))) for m in FENCE.finditer(doc)]


def prose(doc: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", doc)


def code(doc: str) -> list[str]:
    """Every piece of code: fenced blocks (continued lines joined) and inline spans outside
    them (on one line)."""
    blocks = [body.replace("\\\n", " ") for _, body in fences(doc)]
    return blocks + [span.replace("\n", " ") for span in INLINE.findall(prose(doc))]


def report(bad: list[tuple[Path, str]], what: str) -> str:
    lines = [f"  {rel(path)}: {name}" for path, name in sorted(set(bad))]
    return f"{len(lines)} {what} named in the docs do not exist:\n" + "\n".join(lines)


# --- config keys -------------------------------------------------------------------------------


def _block(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _free_form(annotation: Any) -> bool:
    """A field whose value is a mapping the schema does not describe key by key."""
    if annotation is Any or annotation is dict or get_origin(annotation) is dict:
        return True
    return any(_free_form(a) for a in get_args(annotation) if a is not type(None))


def config_key_exists(parts: list[str]) -> bool:
    model: type[BaseModel] = RolloutRecoveryConfig
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        sub = _block(field.annotation)
        if sub is None:
            return i == len(parts) - 1 or _free_form(field.annotation)
        model = sub
    return True  # a block


def module_path_exists(parts: list[str]) -> bool:
    """`rollout_recovery.a.b[.Name]`: each lowercase segment a package or module, down to the
    first module (what follows a module, or a capitalised segment, is an attribute)."""
    here = ROOT
    for i, part in enumerate(parts):
        if not here.is_dir() or part[:1].isupper():
            return i > 1
        if not (here / part / "__init__.py").exists():
            return (here / f"{part}.py").exists()  # a module ends the path
        here = here / part
    return True


SECTIONS = set(RolloutRecoveryConfig.model_fields)


def dotted_names(doc: str) -> list[str]:
    names = []
    for name in DOTTED.findall(doc):
        if name.split(".")[0] in SECTIONS and name.rsplit(".", 1)[1] not in FILE_EXTENSIONS:
            names.append(name)
    return names


def unknown_dotted(doc: str) -> tuple[list[str], list[str]]:
    """The config keys and `rollout_recovery.*` module paths `doc` names, and the unknown ones."""
    seen, bad = [], []
    for name in dotted_names(doc):
        parts = name.split(".")
        seen.append(name)
        if config_key_exists(parts):
            continue
        if parts[0] == "rollout_recovery" and module_path_exists(parts):
            continue
        if name not in WRONG_ON_PURPOSE:
            bad.append(name)
    return seen, bad


def test_every_config_key_and_module_path_named_in_the_docs_exists():
    seen, bad = set(), []
    for path in DOCS:
        names, unknown = unknown_dotted(text(path))
        seen |= set(names)
        bad += [(path, name) for name in unknown]
    assert not bad, report(bad, "config keys or rollout_recovery modules")
    keys = {n for n in seen if config_key_exists(n.split("."))}
    assert len(keys) > 60, f"only {len(keys)} config keys found: is the pattern still right?"
    for wrong in WRONG_ON_PURPOSE:
        assert not config_key_exists(wrong.split(".")), f"{wrong} is a real key now"


def test_every_yaml_example_uses_known_keys():
    bad, blocks = [], 0

    def walk(path: Path, value: Any, prefix: list[str]) -> None:
        if not isinstance(value, dict):
            return
        for key, sub in value.items():
            parts = [*prefix, str(key)]
            if not config_key_exists(parts):
                bad.append((path, ".".join(parts)))
            elif _block_at(parts) is not None:
                walk(path, sub, parts)

    for path in DOCS:
        for lang, body in fences(text(path)):
            if lang not in ("yaml", "yml"):
                continue
            data = yaml.safe_load(body)
            if not isinstance(data, dict) or not set(data) & SECTIONS:
                continue  # not a job configuration
            blocks += 1
            walk(path, {k: v for k, v in data.items() if k != "extends"}, [])
    assert not bad, report(bad, "config keys in YAML examples")
    assert blocks >= 5, f"only {blocks} YAML configuration examples found"


def _block_at(parts: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = RolloutRecoveryConfig
    for part in parts:
        model = _block(model.model_fields[part].annotation) if model else None
    return model


def test_every_name_a_python_example_imports_exists():
    bad, seen = [], 0
    for path in DOCS:
        for lang, body in fences(text(path)):
            if lang != "python":
                continue
            for module, grouped, names in FROM_IMPORT.findall(body):
                source = _module_source(module)
                for name in (n.strip() for n in (grouped or names).split(",") if n.strip()):
                    seen += 1
                    if source is None or not re.search(rf"\b{re.escape(name)}\b", source):
                        bad.append((path, f"from {module} import {name}"))
    assert not bad, report(bad, "imports")
    assert seen >= 5, f"only {seen} imported names found"


def _module_source(module: str) -> str | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.exists():
            return candidate.read_text()
    return None


# --- the command line --------------------------------------------------------------------------


def _subparsers(parser) -> dict[str, Any]:
    for action in parser._actions:
        if action.choices and hasattr(action, "_name_parser_map"):
            return dict(action.choices)
    return {}


def _options(parser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def unknown_commands(doc: str) -> tuple[int, list[str]]:
    """Each `rollout-recovery SUB [ACTION] [--option ...]` in `doc`'s code: the subcommand, the
    action of a command that has actions, and every option must exist."""
    top = build_parser()
    subs = _subparsers(top)
    seen, bad = 0, []
    for snippet in code(doc):
        for match in COMMAND.finditer(snippet):
            words = match.group(1).split()
            if not words:
                continue
            seen += 1
            head = words[0]
            if head.startswith("-"):
                parser, rest = top, words
            elif head in subs:
                parser, rest = subs[head], words[1:]
                actions = _subparsers(parser)
                if actions:
                    if not rest or any(a not in actions for a in rest[0].split("|")):
                        bad.append(f"rollout-recovery {head} {rest[0] if rest else ''}".strip())
                        continue
                    parser, rest = actions[rest[0].split("|")[0]], rest[1:]
            else:
                bad.append(f"rollout-recovery {head}")
                continue
            for word in rest:
                option = word.split("=")[0].strip("[]()'\",")
                if option.startswith("--") and option not in _options(parser):
                    bad.append(f"rollout-recovery {head} {option}")
    return seen, bad


def test_every_cli_command_named_in_the_docs_exists():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert build_parser().prog in scripts, "the parser's name is not an installed script"
    bad, seen = [], 0
    for path in DOCS:
        n, unknown = unknown_commands(text(path))
        seen += n
        bad += [(path, name) for name in unknown]
        for tool in re.findall(r"\.venv/bin/([\w.-]+)", text(path)):
            if tool not in scripts and not tool.startswith("python"):
                bad.append((path, f".venv/bin/{tool}"))
    assert not bad, report(bad, "commands or options")
    assert seen >= 20, f"only {seen} rollout-recovery commands found"
    named = {w for p in DOCS for s in code(text(p)) for w in COMMAND.findall(s)}
    for sub in _subparsers(build_parser()):
        assert any(n.split()[:1] == [sub] for n in named), f"no doc shows `rollout-recovery {sub}`"


# --- metrics -----------------------------------------------------------------------------------


@cache
def metric_names() -> tuple[frozenset[str], frozenset[str], str]:
    """The workers' Prometheus series, the run's count families, and the run metrics' prefix."""
    from rollout_recovery.controller import metrics

    worker_source = (PACKAGE / "generation" / "metrics.py").read_text()
    series = frozenset(re.findall(r"\"(rollout_recovery_\w+)\"", worker_source))
    documented = re.findall(r"`([a-z_][\w.<>]*)`", metrics.__doc__ or "")
    names = [*metrics.FIXED, *(n for n in documented if not n.startswith("rollout_recovery"))]
    families = frozenset(re.sub(r"\W", "_", n.split(".")[0]) for n in names)
    return series, families, metrics.PREFIX


def metric_exists(name: str) -> bool:
    series, families, prefix = metric_names()
    if name.startswith(prefix):
        return name.removeprefix(prefix) in families
    base = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
    return name in series or base in series


def test_every_metric_named_in_the_docs_exists():
    bad, seen = [], set()
    for path in DOCS:
        for name in METRIC.findall(text(path)):
            seen.add(name)
            if not metric_exists(name):
                bad.append((path, name))
    assert not bad, report(bad, "metrics")
    series, _, _ = metric_names()
    assert len(series) >= 10 and len(seen) >= 10, (len(series), sorted(seen))


# --- paths and links ---------------------------------------------------------------------------


@cache
def python_basenames() -> frozenset[str]:
    dirs = [PACKAGE, ROOT / "scripts", ROOT / "functional_tests", ROOT / "tests"]
    return frozenset(p.name for d in dirs for p in d.rglob("*.py"))


def path_exists(name: str, doc: Path) -> bool:
    if "*" in name:
        return any(ROOT.glob(name))
    return any((base / name).exists() for base in (ROOT, PACKAGE, doc.parent))


def unknown_paths(doc_path: Path, doc: str) -> tuple[int, list[str]]:
    seen, bad = 0, []
    for name in ROOTED_PATH.findall(doc):
        seen += 1
        if not path_exists(name, doc_path):
            bad.append(name)
    for name in RELATIVE_PATH.findall(doc):
        if name.startswith(REPO_ROOTS):
            continue
        seen += 1
        if not path_exists(name, doc_path):
            bad.append(name)
    for name in BARE_MODULE.findall(doc):
        seen += 1
        if name not in python_basenames() and name not in READERS_FILES:
            bad.append(name)
    return seen, bad


def test_every_repository_path_named_in_the_docs_exists():
    bad, seen = [], 0
    for path in DOCS:
        n, unknown = unknown_paths(path, text(path))
        seen += n
        bad += [(path, name) for name in unknown]
    assert not bad, report(bad, "paths")
    assert seen >= 150, f"only {seen} paths found"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.+)$", prose(text(path)), re.M)}


def test_every_link_in_the_docs_is_local_and_resolves():
    bad, seen = [], 0
    for path in DOCS:
        doc = text(path)
        for target in LINK.findall(prose(doc)) + re.findall(r"<(\w+://[^>]+)>", prose(doc)):
            seen += 1
            if re.match(r"\w+:", target) or target.startswith("//"):
                bad.append((path, f"{target} (links outside the repository)"))
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append((path, f"{target} (no such file)"))
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append((path, f"{target} (no such heading)"))
        for host in URL.findall(prose(doc)) + [h for c in code(doc) for h in URL.findall(c)]:
            if host not in LOCAL_HOSTS:
                bad.append((path, f"a URL on {host} (links outside the repository)"))
    assert not bad, report(bad, "links")
    assert seen >= 60, f"only {seen} links found"


# --- the pages themselves ----------------------------------------------------------------------


def test_the_docs_index_lists_every_page():
    index = text(ROOT / "docs" / "README.md")
    linked = {target.partition("#")[0] for target in LINK.findall(index)}
    missing = [p.name for p in DOCS[1:] if p.name != "README.md" and p.name not in linked]
    assert not missing, f"docs/README.md does not list: {', '.join(missing)}"


def test_the_readme_is_a_landing_page():
    readme = text(ROOT / "README.md")
    assert len(readme.splitlines()) <= 250, "README.md is a landing page: reference goes to docs/"
    commands = readme.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    assert [line.split()[0] for line in commands.splitlines()] == [
        "scripts/demo.sh",
        "scripts/test.sh",
    ]
    assert "docs/README.md" in readme


def test_the_layout_names_files_that_exist():
    """Each entry of docs/layout.md's tree (a directory and the lines under it) names only
    modules that exist in that directory."""
    [tree] = [body for lang, body in fences(text(ROOT / "docs" / "layout.md")) if not lang]
    bad, stack, entries = [], [], 0
    for line in tree.splitlines():
        match = re.match(r"^( *)(\S+)( |$)", line)
        if match and len(match.group(1)) % 2 == 0 and len(match.group(1)) < 8:
            depth, name = len(match.group(1)) // 2, match.group(2)
            stack = [*stack[:depth], name]
            entries += 1
            if not (ROOT / "".join(stack)).exists():
                bad.append((ROOT / "docs" / "layout.md", "".join(stack)))
        here = ROOT / "".join(stack)
        folder = here if here.is_dir() else here.parent
        for module in re.findall(r"\(([a-z_]\w*\.py)\b|(?<=, )([a-z_]\w*\.py)\b", line):
            name = module[0] or module[1]
            if not (folder / name).exists():
                bad.append((ROOT / "docs" / "layout.md", f"{rel(folder)}/{name}"))
    assert not bad, report(bad, "layout entries")
    assert entries >= 30, f"only {entries} layout entries found"


def test_the_checkers_catch_a_renamed_name():
    """Each checker flags a wrong name, so a pass above means the names were checked."""
    assert unknown_dotted("set `vllm_cfg.max_model_length`")[1] == ["vllm_cfg.max_model_length"]
    assert unknown_dotted("`placement.store.shard`")[1] == ["placement.store.shard"]
    assert unknown_dotted("`rollout_recovery.campaign.crash_points`")[1] != []
    assert unknown_dotted("`environment.settings.anything` `vllm_cfg.dtype`")[1] == []
    assert unknown_commands("`rollout-recovery snapshot ls DIR`")[1] != []
    assert unknown_commands("`rollout-recovery train --resume`")[1] != []
    assert unknown_commands("`rollout-recovery snapshots ls|show|verify DIR`")[1] == []
    assert not metric_exists("rollout_recovery_cut_call")
    assert not metric_exists("rollout_recovery_run_run_stall")
    assert metric_exists("rollout_recovery_run_run_stalled")
    doc = ROOT / "docs" / "design.md"
    assert unknown_paths(doc, "`rollout_recovery/faultfs.py` and `environment/runner2.py`")[1] == [
        "rollout_recovery/faultfs.py",
        "environment/runner2.py",
    ]
