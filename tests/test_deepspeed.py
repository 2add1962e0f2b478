"""DeepSpeed (CPU accelerator, 2 gloo ranks) with seed 002's recipe: ``deepspeed.initialize(model=
ORTModule(model), optimizer=...)`` and ``FP16_Optimizer`` around the optimizer it returns, in step
with the same DeepSpeed run on the plain model without ZeRO (fp16) and at ZeRO stages 1, 2 and 3
(fp32 and fp16; at stage 3 every parameter partitioned, gathered by ORTModule for its forward and again
for its backward). FP16_Optimizer on the plain model leaves
DeepSpeed's steps as they were (its norm and overflow checks replaced: DeepSpeed's own are not
called). Skipped without DeepSpeed (.ci/run installs it)."""
import importlib.util

import numpy as np
import pytest
import torch

from . import deepspeed_worker as worker
from . import models

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")

KINDS = {0: "DeepSpeed fp16", 1: "DeepSpeed ZeRO stage 1/2", 2: "DeepSpeed ZeRO stage 1/2", 3: "DeepSpeed ZeRO stage 3"}


def assert_same_run(ours, theirs, rtol, atol):
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=rtol, atol=atol)
    np.testing.assert_allclose(ours["norms"], theirs["norms"], rtol=rtol, atol=atol)
    assert ours["loss_scale"] == theirs["loss_scale"]
    for name, want in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], want, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_zero_with_ortmodule_and_fp16_optimizer(tmp_path, stage):
    initial = dict(models.mlp().named_parameters())
    for rank, (returncode, stderr) in enumerate(worker.launch(tmp_path, stage)):
        assert returncode == 0, f"rank {rank} exited with {returncode}:\n{stderr[-3000:]}"
    for rank in range(worker.WORLD_SIZE):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for fp16 in worker.precisions(stage):
            plain, wrapped, ours = (result[fp16, run] for run in worker.RUNS)
            # The non-finite step is skipped by all (DeepSpeed's global norm: inf), the others train.
            assert [np.isinf(n) for n in plain["norms"]] == [s == worker.NON_FINITE_STEP for s in range(worker.STEPS)]
            assert all(not torch.allclose(plain["weights"][name], p.float(), atol=1e-3) for name, p in initial.items())
            # FP16_Optimizer on the plain model: DeepSpeed's steps, with our checks instead of its own.
            assert wrapped["kind"] == KINDS[stage]
            assert_same_run(wrapped, plain, rtol=1e-6, atol=0)
            if stage == 0:
                assert plain["calls"]["CheckOverflow.has_overflow_serial"] > 0, plain["calls"]
            elif stage != 3:
                assert plain["calls"]["DeepSpeedZeroOptimizer.get_grad_norm_direct"] > 0, plain["calls"]
                overflow_checks = plain["calls"]["DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial"]
                assert (overflow_checks > 0) is fp16, plain["calls"]
            if stage != 3:
                assert set(wrapped["calls"].values()) == set(ours["calls"].values()) == {0}
            # Seed 002's recipe: ORTModule in step with the plain model (fp32: ~1e-7 relative; fp16: one
            # fp16 rounding, 1e-3 of weights that a wrong gradient moves by lr = 1e-2).
            assert ours["kind"] == KINDS[stage]
            assert_same_run(ours, plain, *((2e-3, 2e-3) if fp16 else (1e-5, 1e-6)))
            # ZeRO-3: the parameters partitioned after the forward (each rank holds its part), by both
            assert ours["partitioned"] == plain["partitioned"] == [stage == 3] * len(initial)
