"""The `quick` marker: a first check across the stages, in about a minute (README, Development:
`python -m pytest -q -m quick`), before the whole suite."""
import pytest

# One test per concern along a batch's path: options, export, the training graph in step with eager
# PyTorch (ORTTrainer and ORTModule), the optimizers' math, checkpoints, the README's first snippet.
QUICK = (
    "tests/test_layering.py::test_imports_run_down_the_stages",
    "tests/test_validation.py::test_options_defaults",
    "tests/test_export_onnx.py::test_mlp_export_has_dynamic_batch_and_matches_torch",
    "tests/test_trainer_parity.py::test_mlp_parity",
    "tests/test_trainer_parity.py::test_transformer_parity",
    "tests/test_ortmodule.py::test_mlp_trains_like_eager_with_sgd",
    "tests/test_optimizers.py::test_adam_reference_mode_0_matches_torch_adamw",
    "tests/test_trainer_checkpoint.py::test_checkpoint_weights_load_into_the_plain_torch_model",
    "tests/test_docs.py::test_the_readme_snippet_runs_as_written",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in QUICK:
            item.add_marker(pytest.mark.quick)
