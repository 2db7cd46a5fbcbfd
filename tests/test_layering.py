"""Imports run one way between the project's packages (docs/layout.md): a module imports only
packages of a lower layer, never one of its own layer or above, except the pairs listed in ALLOWED
with the reason each is there. Every import counts, including the lazy ones inside functions."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package (folder) or top-level module -> layer; lower layers never import higher ones
LAYERS = {
    "utils": 0,
    "tokenizer": 1, "model": 1,
    "data_preprocess": 2, "optimizer": 2,  # optimizer/ steps over parallel/'s DDP by duck typing only
    "parallel": 3, "dataset": 3, "evals": 3,
    # one package owns checkpoint files: it reads the engines' state (parallel/engine.py StateSpec) and the optimizers'
    # state formats, and the trainer saves through its manager; the torch-free names and sidecar schema that lower
    # layers read (model/config.py, the supervisor, the pre-checks) stay in utils/checkpoint_layout.py, checkpoint_json.py
    "checkpoint": 4,
    "trainer": 5,  # the trainer's pieces (config, start, loop, task, weights, samples, faults)
    "monitor": 5,  # the supervisor's pieces under monitor_process.py (torch-free: imports utils/ only)
    # loading a trained model for inference (the checkpoint a --ckpt/--checkpoint names, the recorded tokenizer):
    # below sample.py and eval_lm.py, which share it and so never import each other
    "inference": 6,
    "train_my_ddp": 6, "export_hf": 6, "monitor_process": 6,
    "sample": 7, "eval_lm": 7,
}
ALLOWED = {
    # growing a vocabulary (model/resize.py) reads the tokenizer that was grown; nothing else in model/
    ("model/resize.py", "tokenizer"): "model/resize.py's header",
}
SKIP_DIRS = {".venv", "tests", "bench", "scripts", "docs", "config", "data", "out", "__pycache__", ".git"}


def _unit(rel: str) -> str:
    """The layered unit a file belongs to: its top folder, or the module name of a top-level file."""
    return rel.split(os.sep)[0] if os.sep in rel else rel[:-3]


def _imports(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno


def project_files(root: str):
    """Every project module (a .py file outside SKIP_DIRS), relative to `root`."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, name), root)


def layer_violations(root: str = ROOT) -> list[str]:
    problems = []
    for rel in project_files(root):
        unit = _unit(rel)
        if unit not in LAYERS:
            problems.append(f"{rel}: {unit} has no layer in tests/test_layering.py LAYERS")
            continue
        for target, line in _imports(os.path.join(root, rel)):
            if target == unit or target not in LAYERS:
                continue  # itself, or the standard library / a third-party package
            if (unit, target) in ALLOWED or (rel, target) in ALLOWED:
                continue
            if LAYERS[target] >= LAYERS[unit]:
                problems.append(f"{rel}:{line}: {unit} (layer {LAYERS[unit]}) imports {target} "
                                f"(layer {LAYERS[target]})")
    return problems


def test_every_project_module_has_a_layer_and_imports_run_one_way():
    assert layer_violations() == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check itself: a lazy import of model/ (one layer up) inside utils/ is reported with its line;
    model/ importing utils/ (down) and a module without a layer are told apart."""
    (tmp_path / "utils").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "utils" / "bad.py").write_text("import os\n\ndef f():\n    from model.llama import Transformer\n")
    (tmp_path / "model" / "ok.py").write_text("from utils.bad import f\n")
    assert layer_violations(str(tmp_path)) == [f"{os.path.join('utils', 'bad.py')}:4: utils (layer 0) imports model (layer 1)"]
    (tmp_path / "stray.py").write_text("import utils\n")
    assert "stray.py: stray has no layer in tests/test_layering.py LAYERS" in layer_violations(str(tmp_path))


def _module_graph(root: str = ROOT) -> dict[str, set[str]]:
    """Project module -> the project modules it imports (every import, lazy ones included; `from pkg import
    sub` is an edge to the submodule when `sub` is one, else to the package)."""
    mods = {}
    for rel in project_files(root):
        name = rel[:-3].replace(os.sep, ".")
        mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = rel
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, rel in mods.items():
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def import_cycles(root: str = ROOT) -> list[list[str]]:
    graph, state, stack, cycles = _module_graph(root), {}, [], []

    def visit(u: str) -> None:
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycle_between_project_modules():
    """Issue 34: no cycle, and so no lazy import that only hides one (lazy imports are counted as edges)."""
    assert import_cycles() == []


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "a.py").write_text("from utils import b\n")
    (tmp_path / "utils" / "b.py").write_text("def f():\n    from utils.a import x\n")
    assert import_cycles(str(tmp_path)) == [["utils.a", "utils.b", "utils.a"]]
