"""Layout: the library core never imports the offline kit (`mempo_trl.kit`); only the command layer does. The
package never imports the lab (`lab/`, the experiments outside it) nor names the code that moved there."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import mempo_trl


PACKAGE = Path(mempo_trl.__file__).parent
# The command line (and the kit itself) may use the kit for its offline defaults; nothing else may.
FRONT_ENDS = ("kit", "commands", "cli.py", "__main__.py")


def core_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in FRONT_ENDS:
            continue
        parts = ["mempo_trl", *relative.with_suffix("").parts]
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def kit_imports(tree: ast.AST) -> list[str]:
    """Every `import mempo_trl.kit...` / `from mempo_trl.kit... import` / `from mempo_trl import kit` in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("mempo_trl.kit")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("mempo_trl.kit"):
                found.append(node.module)
            elif node.module == "mempo_trl" and any(a.name == "kit" for a in node.names):
                found.append("mempo_trl.kit")
    return found


def test_core_list_covers_the_library():
    names = core_modules()
    for expected in ("mempo_trl.trainer", "mempo_trl.config", "mempo_trl.evaluation", "mempo_trl.retrieval.bm25"):
        assert expected in names
    assert not any(name.startswith(("mempo_trl.kit", "mempo_trl.commands")) for name in names)


def test_core_source_never_imports_the_kit():
    """Also catches imports inside functions, which an import-time check would miss."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in FRONT_ENDS:
            continue
        found = kit_imports(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}


def test_kit_imports_are_detected():
    tree = ast.parse("def f():\n    from mempo_trl.kit.tiny import load_tiny\nfrom mempo_trl import kit\n")
    assert sorted(kit_imports(tree)) == ["mempo_trl.kit", "mempo_trl.kit.tiny"]


def test_importing_core_modules_loads_no_kit_module():
    """Import each core module in one fresh interpreter; after each, no `mempo_trl.kit` module may be loaded."""
    script = (
        "import importlib, json, sys\n"
        "loaded = {}\n"
        f"for name in {core_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "    kit = sorted(m for m in sys.modules if m == 'mempo_trl.kit' or m.startswith('mempo_trl.kit.'))\n"
        "    if kit:\n"
        "        loaded[name] = kit\n"
        "        break\n"
        "print(json.dumps(loaded))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


COMMANDS = PACKAGE / "commands"


def test_commands_never_import_the_kit():
    """The command layer reaches the kit only by the paths a recipe names (`mempo-trl kit ...` writes them)."""
    offenders = {}
    for path in sorted(COMMANDS.rglob("*.py")):
        found = kit_imports(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            offenders[path.name] = found
    assert offenders == {}


def test_commands_do_not_import_the_dispatcher():
    """`mempo_trl.cli` imports the command modules; they never import it back (no import loop)."""
    for path in sorted(COMMANDS.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert "mempo_trl.cli" not in modules, path.name


LAB = Path(__file__).resolve().parents[1] / "lab"
MOVED = (
    "mempo_trl.kit.induction",
    "induction_pretrain",
    "HorizonWorld",
    "horizon_world",
    "HORIZON_SPLITS",
    "build_learner",
    "derive_learner",
    "LEARNER_WARM",
    "resolve_environment",
)
"""Lab-only code that left the package: what was `mempo_trl.kit.induction`, the horizon world and the learner's
build and warm-start settings (`lab/induction_pretraining.py`, `lab/horizon_world.py`, `lab/learning.py`); and dead
code deleted (`kit.envs.resolve_environment`)."""


def lab_modules() -> set[str]:
    """The names the lab's modules import by (`lab/` is on the lab's path, not a package), and ``lab`` itself."""
    return {"lab"} | {path.stem for path in LAB.glob("*.py")}


def imported_roots(tree: ast.AST) -> set[str]:
    """The top-level name of every absolute import in a module, inside functions too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_lab_imports_are_detected():
    tree = ast.parse("def f():\n    import long_horizon.x\nfrom lab.learning import BUDGET\nfrom . import kit\n")
    assert imported_roots(tree) & lab_modules() == {"lab", "long_horizon"}


def test_the_package_never_imports_the_lab():
    assert {"long_horizon", "learning", "induction_pretraining", "horizon_world"} <= lab_modules()
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = imported_roots(ast.parse(path.read_text(encoding="utf-8"))) & lab_modules()
        if found:
            offenders[str(path.relative_to(PACKAGE))] = sorted(found)
    assert offenders == {}


def test_the_package_names_no_lab_only_code():
    """No module, doctest or docstring of the package refers to the code that moved to the lab."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found = [name for name in MOVED if name in text]
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}


def test_the_lab_imports_no_private_name_of_the_package():
    """The lab, the benches and the scripts use the package's public names only (a private one can change unseen)."""
    root = LAB.parent
    offenders = []
    for path in sorted([*LAB.rglob("*.py"), *(root / "bench").rglob("*.py"), *(root / "scripts").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mempo_trl"):
                offenders += [f"{path.relative_to(root)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []


def test_every_public_name_of_the_kit_has_a_user_outside_the_lab():
    """A kit name that only the lab uses belongs in the lab, and one nobody uses is dead: each public top-level name of
    `mempo_trl.kit` is named somewhere in the package (besides its definition), the tests, the examples (the
    notebook), the benches or the scripts."""
    root = LAB.parent
    texts = {
        path: path.read_text(encoding="utf-8", errors="ignore")
        for folder in ("src", "tests", "examples", "bench", "scripts")
        for path in (root / folder).rglob("*")
        if path.suffix in (".py", ".ipynb", ".sh", ".yaml") and path.is_file()
    }
    unused = []
    for module in sorted((PACKAGE / "kit").glob("*.py")):
        for node in ast.parse(module.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            for name in (n for n in names if not n.startswith("_")):
                word = re.compile(rf"\b{name}\b")
                uses = sum(len(word.findall(text)) - (path == module) for path, text in texts.items())
                if uses <= 0:
                    unused.append(f"{module.name}: {name}")
    assert unused == []
