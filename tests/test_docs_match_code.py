"""The docs say what the code does: every setting in docs/settings.md's table with its flag and default,
every error code and close code in docs/protocol.md's "Errors and limits", every file in docs/layout.md's
tree, every file docs/architecture.md names with what it defines.

These read the documents as a person does (the table's rows, the paragraph's backticked codes) and compare
them with the code's own lists, in both directions.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from gateway.cli import build_parser
from gateway.protocol import CloseCode, ErrorCode
from gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
UNITS = {"KiB": 1024, "MiB": 1024 * 1024}


def settings_rows() -> list[tuple[str, str, str]]:
    """(flag, variable, default) cells of docs/settings.md's table."""
    section = (ROOT / "docs" / "settings.md").read_text().split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`VOXGATE_"):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def variables(cell: str) -> list[str]:
    return re.findall(r"`VOXGATE_([A-Z0-9_]+)`", cell)


def documented_value(cell: str):
    """The value a default cell states: a number (with KiB/MiB), on/off, `{}`, a word in backticks; or
    None when it says in words what an unset default (None, an empty list) means: `–`, "none", "backend's
    first", ... A setting with a value must state it, and one without must not seem to have one."""
    cell = cell.strip()
    if match := re.fullmatch(r"`?(-?\d+(?:\.\d+)?)`?\s*(KiB|MiB)?(\s*\(.*\))?", cell):
        return float(match.group(1)) * UNITS.get(match.group(2) or "", 1)
    if cell in ("on", "off"):
        return cell == "on"
    if match := re.fullmatch(r"`([^`]*)`", cell):
        return match.group(1)
    return None


def comparable(value):
    """A setting's default as documented_value reads its cell."""
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if value == {}:
        return "{}"
    assert value in (None, []), f"no way to document the default {value!r}"
    return None


def serve_flags() -> dict[tuple[str, ...], str]:
    """`voxgate serve`'s options (each with its spellings, e.g. ("--option", "-o")) -> the setting it sets."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {"option": "backend_options"}  # -o KEY=VALUE pairs are gathered into backend_options
    return {tuple(action.option_strings): dests.get(action.dest, action.dest)
            for action in serve._actions if action.option_strings and action.dest != "help"}


def test_every_setting_is_in_the_settings_table_and_every_row_is_a_setting():
    documented = [name.lower() for _, cell, _ in settings_rows() for name in variables(cell)]
    fields = set(GatewaySettings.model_fields)
    assert len(documented) == len(set(documented)), f"settings in two rows: {sorted(documented)}"
    assert sorted(fields - set(documented)) == [], "settings missing from docs/settings.md's table"
    assert sorted(set(documented) - fields) == [], "docs/settings.md's table names settings that do not exist"


def test_every_documented_default_is_the_settings_default():
    wrong = []
    for _, variable_cell, default_cell in settings_rows():
        names = [n.lower() for n in variables(variable_cell)]
        defaults = [d.strip() for d in default_cell.split(" / ")] if len(names) > 1 else [default_cell]
        assert len(defaults) == len(names), f"{variable_cell}: {len(names)} settings, {len(defaults)} defaults"
        for name, cell in zip(names, defaults):
            field = GatewaySettings.model_fields[name]
            actual = field.get_default(call_default_factory=True)
            if comparable(actual) != documented_value(cell):
                wrong.append(f"VOXGATE_{name.upper()}: docs/settings.md says {cell!r}, the default is {actual!r}")
    assert not wrong, "\n".join(wrong)


def test_every_serve_flag_is_in_the_settings_table_on_the_row_of_its_setting():
    rows = {}
    for flag_cell, variable_cell, _ in settings_rows():
        for flag in re.findall(r"`(--?[a-z][a-z-]*)", flag_cell):
            rows[flag] = [n.lower() for n in variables(variable_cell)]
    wrong = []
    for spellings, setting in serve_flags().items():
        documented = [flag for flag in spellings if flag in rows]
        if not documented:
            wrong.append(f"{'/'.join(spellings)} (sets {setting}) is not in docs/settings.md's table")
        wrong += [f"{flag} sets {setting}, its row documents {rows[flag]}" for flag in documented
                  if rows[flag] != [setting]]
    taken = {flag for spellings in serve_flags() for flag in spellings}
    wrong += [f"docs/settings.md lists {flag}, which voxgate serve does not take" for flag in rows if flag not in taken]
    assert not wrong, "\n".join(wrong)


def errors_section() -> str:
    text = (ROOT / "docs" / "protocol.md").read_text()
    return text.split("## Errors and limits", 1)[1].split("\n## ", 1)[0]


def test_the_protocol_lists_every_error_code_and_nothing_else():
    section = errors_section()
    listed = section.split("Every error carries a stable `code`:", 1)[1].split("`retryable`", 1)[0]
    documented = set(re.findall(r"`([a-z_]+)`", listed))
    assert documented == {code.value for code in ErrorCode}


@pytest.mark.parametrize("code", [int(c) for c in CloseCode])
def test_the_protocol_lists_every_close_code(code):
    assert re.search(rf"\b{code} [a-z]", errors_section()), f"close code {code} is not in docs/protocol.md"


def warning_codes_in_the_code() -> set[str]:
    """Every warning code the gateway can send: the `code="..."` of its ConfigWarnings (and the default of
    compat's `ignored`), found in the source."""
    codes: set[str] = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        text = path.read_text()
        codes |= set(re.findall(r'\bcode="([a-z_]+)"', text))
        codes |= set(re.findall(r'\bcode: str = "([a-z_]+)"', text))
    return codes


def test_the_protocol_lists_every_warning_code_and_nothing_else():
    """session.started's row of docs/protocol.md lists the codes of `warnings`, which audio.start and the
    HTTP X-Voxgate-Warnings header share."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `session.started` |"))
    listed = row.split("list of `{code, message, field}`:", 1)[1]
    assert set(re.findall(r"`([a-z_]+)`", listed)) == warning_codes_in_the_code()


def layout_tree() -> dict[str, list[str]]:
    """docs/layout.md's tree: each folder it lists (relative to the repository, "" for the root) -> the
    names listed inside it (a folder's name ends with "/"). A line is `name  description`, indented two
    spaces per level."""
    text = (ROOT / "docs" / "layout.md").read_text()
    (block,) = re.findall(r"^```text\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    tree: dict[str, list[str]] = {"": []}
    parents = [""]
    for line in filter(str.strip, block.splitlines()):
        depth, rest = divmod(len(line) - len(line.lstrip(" ")), 2)
        assert rest == 0 and depth < len(parents), f"docs/layout.md: badly indented line {line!r}"
        name = line.split()[0]
        del parents[depth + 1:]
        tree[parents[depth]].append(name)
        if name.endswith("/"):
            folder = parents[depth] + name
            tree.setdefault(folder, [])
            parents.append(folder)
    return {folder: names for folder, names in tree.items()}


def repository_files() -> list[str]:
    """The repository's files as git sees them: tracked, or new and not ignored."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [path for path in listed if (ROOT / path).is_file()]


def test_the_layout_lists_every_file_of_each_folder_it_opens():
    """A folder whose contents docs/layout.md lists (the root, gateway/, tts_backend/engine/, ...) lists all
    of them, files and folders, and nothing that is not there; a folder it names without contents is
    described as a whole (bench/, tests/)."""
    tree = layout_tree()
    inside: dict[str, set[str]] = {folder: set() for folder in tree}
    for path in repository_files():
        parts = path.split("/")
        for depth in range(len(parts)):
            folder = "".join(part + "/" for part in parts[:depth])
            if folder in inside:
                inside[folder].add(parts[depth] + ("/" if depth < len(parts) - 1 else ""))
    wrong = []
    for folder, names in tree.items():
        if not names:
            continue
        listed = set(names)
        wrong += [f"{folder}{name} is in the repository, not in docs/layout.md" for name in inside[folder] - listed]
        wrong += [f"docs/layout.md lists {folder}{name}, which is not in the repository"
                  for name in listed - inside[folder]]
    assert not wrong, "\n".join(sorted(wrong))


def source_file(named: str) -> Path:
    """The package file that architecture.md names by its path inside gateway/ or tts_backend/."""
    found = [path for package in ("gateway", "tts_backend") for path in (ROOT / package).rglob("*.py")
             if path.as_posix().endswith("/" + named)]
    assert len(found) == 1, f"docs/architecture.md names `{named}`: {len(found)} files match"
    return found[0]


def implements(path: Path, name: str) -> bool:
    """`path` defines a function or method `name` with a body (not an abstract method)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            decorators = {ast.unparse(d) for d in node.decorator_list}
            if not decorators & {"abstractmethod", "abc.abstractmethod"}:
                return True
    return False


def test_architecture_names_the_files_that_implement_what_it_says():
    """"(`store/memory.py` or `store/redis.py`, `apply`)": each file named beside a function implements
    it; "`SpeechPipeline.enqueue` (`session/pipeline.py`)": the file defines the class and the method."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    claims = []
    for match in re.finditer(r"(?:`([A-Z]\w*)\.(\w+)` )?\(([^()]*)\)", text):
        files = re.findall(r"`([\w/]+\.py)`", match.group(3))
        names = [n for n in re.findall(r"`([a-z_]\w*)`", match.group(3))]
        if match.group(1):
            claims += [(f, match.group(2)) for f in files]
            claims += [(f, match.group(1)) for f in files]
        elif files and names:
            claims += [(f, n) for f in files for n in names]
    assert ("store/redis.py", "apply") in claims and ("session/pipeline.py", "enqueue") in claims
    wrong = []
    for named, name in claims:
        path = source_file(named)
        tree = ast.parse(path.read_text())
        is_class = any(isinstance(n, ast.ClassDef) and n.name == name for n in ast.walk(tree))
        if not (is_class or implements(path, name)):
            wrong.append(f"docs/architecture.md: `{named}` does not implement `{name}`")
    assert not wrong, "\n".join(wrong)
