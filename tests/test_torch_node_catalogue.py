"""The torch-node catalogue (`ort_trainer._torch_node_catalogue`) against the registries where the
parts of each operator live: every operator has its kernel, its shape rule (or says why it needs
none) and its gradient (or says why it needs none); no registry holds an operator it does not list;
no module spells an operator's name but the catalogue."""
import ast
import re
from pathlib import Path

from ort_trainer._graph.torch_node_shapes import SHAPE_RULES
from ort_trainer._runtime.torch_ops import IMPLEMENTATIONS
from ort_trainer._torch_node_catalogue import (BUILT_GRAPHS_ONLY, CATALOGUE, FUNCTION, FUNCTION_GRAD, RRELU_SLOPES,
                                               SHAPE_RULE, STOP_GRADIENT, TRACED, TYPED_BY_THE_BUILDER,
                                               TYPED_WHERE_WRITTEN, draws_random_numbers)

PACKAGE = Path(__file__).resolve().parents[1] / "ort_trainer"


def test_every_operator_has_a_kernel_and_every_kernel_an_operator():
    assert sorted(set(CATALOGUE) - set(IMPLEMENTATIONS)) == [], "catalogued operators without a kernel"
    assert sorted(set(IMPLEMENTATIONS) - set(CATALOGUE)) == [], "kernels of operators the catalogue does not list"


def test_every_operator_has_a_shape_rule_or_says_why_it_needs_none():
    ruled = {name for name, entry in CATALOGUE.items() if entry.shape == SHAPE_RULE}
    assert sorted(ruled - set(SHAPE_RULES)) == [], "operators whose shape rule is missing"
    assert sorted(set(SHAPE_RULES) - ruled) == [], "shape rules of operators the catalogue says need none (or lacks)"
    reasons = {entry.shape for entry in CATALOGUE.values()} - {SHAPE_RULE}
    assert reasons <= {TYPED_WHERE_WRITTEN, TYPED_BY_THE_BUILDER, TRACED}


def test_every_operator_has_a_gradient_or_says_why_it_needs_none():
    for name, entry in CATALOGUE.items():
        assert entry.gradient in (*CATALOGUE, STOP_GRADIENT, BUILT_GRAPHS_ONLY), name
        if entry.gradient in CATALOGUE:  # a gradient node: run by a kernel, typed by the builder, not differentiated
            gradient = CATALOGUE[entry.gradient]
            assert (gradient.gradient, gradient.shape) == (BUILT_GRAPHS_ONLY, TYPED_BY_THE_BUILDER), name
    typed_by_builder = {name for name, entry in CATALOGUE.items() if entry.shape == TYPED_BY_THE_BUILDER}
    assert typed_by_builder == {entry.gradient for entry in CATALOGUE.values() if entry.gradient in CATALOGUE}


def test_only_the_catalogue_spells_an_operator_name():
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch_node_catalogue.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"ort_trainer::\w+",
                                                                                                node.value):
                spelled.append((str(path.relative_to(PACKAGE)), node.value))
    assert spelled == []


def test_only_nodes_of_an_operator_that_may_draw_are_kept_from_recompute():
    for params in ({"function": "multinomial"}, {"function": RRELU_SLOPES}, {"function": "lstm", "draws": True}):
        assert draws_random_numbers(FUNCTION, params)
        assert not draws_random_numbers(FUNCTION_GRAD, params)  # it draws the forward's numbers again
        assert not draws_random_numbers("", params)  # not a torch node
    assert not draws_random_numbers(FUNCTION, {"function": "lstm"})
