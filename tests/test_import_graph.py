"""The import graph of `mempo_trl`: a step's data flows one way down the training chain, the package's layers import
only downwards (the command line, then the commands and the kit, then the library), and nothing imports in a circle
(docs/algorithm.md, "Module map").

Every import statement counts, those inside functions too (they are how a cycle hides from an import-time check).
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import mempo_trl


PACKAGE = Path(mempo_trl.__file__).parent
CHAIN = (
    "turns",
    "offsets",
    "context",
    "protocol",
    "rollout",
    "padding",
    "scoring",
    "memory",
    "memory_scoring",
    "advantages",
    "trainer",
)
"""The stages a training step's data goes through, in order; the turn format (`turns`, `offsets`), the context rebuild
(`context`) and the rules of the game (`protocol`) are shared; `padding` makes the rollout's rows one batch."""


def module_name(path: Path, package: Path) -> str:
    parts = ["mempo_trl", *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the `mempo_trl` modules it imports (``from mempo_trl.x import y`` counts ``mempo_trl.x.y`` when
    that is a module, else ``mempo_trl.x``)."""
    modules = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                }
        graph[name] = {m for m in found if m in modules and m not in (name, "mempo_trl")}
    return graph


def chain_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the one-way chain: a stage imports only stages above it (importing a later one climbs back up),
    and none but the trainer, which runs the rollout, imports the rollout: later stages take the plain rows it emits,
    never its episodes."""
    found = []
    for i, stage in enumerate(CHAIN[:-1]):
        allowed = {f"mempo_trl.{m}" for m in CHAIN[:i] if m != "rollout"}
        for target in sorted(graph.get(f"mempo_trl.{stage}", ())):
            short = target.removeprefix("mempo_trl.")
            if short in CHAIN and target not in allowed:
                found.append(f"{stage} -> {short}")
    return found


LAYERS = {"cli": 3, "commands": 2, "kit": 2, "library": 1}
"""The package's layers, top first: `mempo_trl.cli` (and `python -m mempo_trl`), the `commands` and the offline `kit`,
then the library (the training core and `retrieval`). The kit may use the command helpers to register `mempo-trl
kit`; the commands never import the kit."""


def layer(module: str) -> str:
    """The layer of a `mempo_trl` module (`LAYERS`)."""
    if module in ("mempo_trl.cli", "mempo_trl.__main__"):
        return "cli"
    area = module.split(".")[1] if "." in module else ""
    return area if area in ("commands", "kit") else "library"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer, or of another part of the same layer other than the kit's use of the commands."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = layer(module), layer(target)
            if LAYERS[there] > LAYERS[here] or (
                LAYERS[there] == LAYERS[here] and here != there and (here, there) != ("kit", "commands")
            ):
                found.append(f"{module} -> {target}")
    return found


def cycles(graph: dict[str, set[str]], roots) -> list[list[str]]:
    """Cycles among the modules reachable from ``roots`` (depth-first search; one per back edge)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[node] = "done"

    for node in roots:
        if node not in state:
            visit(node, [])
    return found


def test_the_chain_is_in_the_package():
    graph = import_graph()
    assert all(f"mempo_trl.{stage}" in graph for stage in CHAIN)
    assert "mempo_trl.context" in graph["mempo_trl.rollout"]  # the walk sees real imports


def test_data_flows_down_the_chain():
    assert chain_violations(import_graph()) == []


def test_the_rollout_does_not_score_outcomes():
    """Outcome scores (`mempo_trl.rewards`) come after the rollout: the trainer scores each episode once a step."""
    assert "mempo_trl.rewards" not in import_graph()["mempo_trl.rollout"]


def test_no_import_cycles_in_the_package():
    """Every module, `commands/`, `kit/` and `retrieval/` included, lazy (in-function) imports counted."""
    graph = import_graph()
    assert {"mempo_trl.cli", "mempo_trl.commands.train", "mempo_trl.kit.cli", "mempo_trl.retrieval.settings"} <= set(
        graph
    )
    assert cycles(graph, sorted(graph)) == []


def test_imports_go_down_the_layers():
    assert layer_violations(import_graph()) == []


def test_a_climb_and_a_cycle_are_caught(tmp_path):
    """The checks fail on a stage that reopens the rollout and on two modules that import each other."""
    package = tmp_path / "mempo_trl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rollout.py").write_text("from mempo_trl.context import render_prompt\n")
    (package / "context.py").write_text("def f():\n    from mempo_trl.rollout import Episode\n")
    (package / "scoring.py").write_text("import mempo_trl.rollout\n")
    (package / "memory.py").write_text("from mempo_trl import advantages\n")
    (package / "advantages.py").write_text("")
    graph = import_graph(package)
    assert chain_violations(graph) == ["context -> rollout", "scoring -> rollout", "memory -> advantages"]
    assert cycles(graph, ["mempo_trl.scoring"]) == [["mempo_trl.rollout", "mempo_trl.context", "mempo_trl.rollout"]]


def test_an_upward_and_a_sideways_import_are_caught(tmp_path):
    package = tmp_path / "mempo_trl"
    for folder in (package, package / "kit", package / "commands"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (package / "cli.py").write_text("from mempo_trl.commands import train\nfrom mempo_trl.kit import cli\n")
    (package / "kit" / "__main__.py").write_text("from mempo_trl.cli import main\n")
    (package / "kit" / "cli.py").write_text("from mempo_trl.commands import parse\n")
    (package / "commands" / "train.py").write_text("def f():\n    from mempo_trl.kit import tiny\n")
    (package / "kit" / "tiny.py").write_text("import mempo_trl.data\n")
    (package / "data.py").write_text("def g():\n    import mempo_trl.commands.train\n")
    assert layer_violations(import_graph(package)) == [
        "mempo_trl.commands.train -> mempo_trl.kit.tiny",
        "mempo_trl.data -> mempo_trl.commands.train",
        "mempo_trl.kit.__main__ -> mempo_trl.cli",
    ]


def test_python_m_kit_runs_a_kit_command_without_the_top_level_cli(tmp_path):
    """`python -m mempo_trl.kit build-demo` writes the demo world, and `mempo_trl.cli` is never loaded."""
    code = (
        "import runpy, sys; sys.argv = ['kit', 'build-demo', '--output_dir', sys.argv[1]]\n"
        "try:\n    runpy.run_module('mempo_trl.kit', run_name='__main__')\n"
        "except SystemExit as end:\n    print('rc', end.code, 'mempo_trl.cli' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)},
    )
    assert result.stdout.strip().endswith("rc 0 False"), result.stderr
    assert (tmp_path / "demo" / "corpus.jsonl").is_file()
    usage = subprocess.run(
        [sys.executable, "-m", "mempo_trl.kit"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)},
    )
    assert usage.returncode == 2 and "build-demo" in usage.stdout


def test_every_exported_name_resolves():
    """`from mempo_trl import X` works for every name of `__all__` (the exports are lazy, so a moved function would
    otherwise break only the user who imports it)."""
    missing = []
    for name in mempo_trl.__all__:
        try:
            getattr(mempo_trl, name)
        except (AttributeError, ImportError) as err:
            missing.append(f"{name}: {err}")
    assert not missing, missing
