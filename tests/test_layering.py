"""The package's stages, in the order one batch goes through them: a module imports only from its own
stage and from stages below it (DESIGN.md, "Stages"). An import that runs the wrong way fails here."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ort_trainer"
# Stage of each top-level module or subpackage (a higher number may import a lower one).
STAGES = {
    "_install": 0, "_onnx": 0, "_checkpoint_files": 0, "_configuration": 0, "data": 0, "_torch_node_catalogue": 0,
    "amp": 1,
    "_export": 2,
    "_graph": 3,
    "_runtime": 4,
    "_optimizers": 5,
    "_compile": 6, "optim": 6,
    "_trainer": 7, "ortmodule": 7,
    "pytorch": 8,  # the seed's first front end, over ORTModule
    "__init__": 8,
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts[:-1] if parts[-1] == "__init__" else parts, parts[-1] == "__init__"


def _imported(parts, is_package, node):
    """The ort_trainer-relative module paths an import statement reads."""
    if isinstance(node, ast.ImportFrom) and node.level:
        base = list(parts if is_package else parts[:-1])[:len(parts if is_package else parts[:-1]) - node.level + 1]
        if node.module:
            return [(*base, *node.module.split("."))]
        return [(*base, alias.name) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ort_trainer."):
        return [tuple(node.module.split(".")[1:])]
    return []


def _stage(parts):
    return parts[0] if parts else "__init__"


@pytest.mark.parametrize("path, parts, is_package", list(_modules()), ids=lambda value: str(value))
def test_imports_run_down_the_stages(path, parts, is_package):
    own = _stage(parts)
    assert own in STAGES, f"{path}: a new stage; give it a place in STAGES and DESIGN.md"
    for node in ast.walk(ast.parse(path.read_text())):
        for imported in _imported(parts, is_package, node):
            other = _stage(imported)
            assert other == own or STAGES[other] < STAGES[own], (
                f"{path.relative_to(PACKAGE.parent)} (stage {own}) imports {'.'.join(imported)} (stage {other}), "
                "a stage at or above its own")


def test_no_module_is_longer_than_a_reader_follows_at_once():
    long = {str(path.relative_to(PACKAGE.parent)): lines for path, _, _ in _modules()
            if (lines := len(path.read_text().splitlines())) > 430}
    assert not long


def test_graph_nodes_are_replaced_through_set_nodes():
    """`_onnx.set_nodes` is the one place that empties a graph's node list to refill it."""
    by_hand = [f"{path.relative_to(PACKAGE.parent)}:{number}" for path, _, _ in _modules() if path.name != "_onnx.py"
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"\bdel\s+[\w.\[\]]+\.node\[:\]", line)]
    assert not by_hand, f"use _onnx.set_nodes instead of del <graph>.node[:] + extend: {by_hand}"
