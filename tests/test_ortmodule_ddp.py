"""DistributedDataParallel(ORTModule(model)) on 2 gloo processes trains as one eager process on the
global batch: DDP's gradient hooks fire on the gradients autograd accumulates from the graph."""
import copy

import numpy as np
import torch

from . import models
from . import ortmodule_ddp_worker as worker


def test_ddp_of_ortmodule_on_two_processes_equals_eager_on_the_global_batch(tmp_path):
    for rank, (returncode, stderr) in enumerate(worker.launch(tmp_path)):
        assert returncode == 0, f"rank {rank} exited with {returncode}:\n{stderr[-3000:]}"
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(worker.WORLD_SIZE)]

    model = copy.deepcopy(models.mlp())
    optimizer = worker.make_optimizer(model.parameters())
    expected = []
    for step in range(worker.STEPS):
        x, target = models.mlp_batch(step, worker.GLOBAL_BATCH)
        optimizer.zero_grad()
        loss = models.mlp_loss(model(x), target)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    np.testing.assert_allclose(np.mean([run["losses"] for run in ranks], axis=0), expected, rtol=1e-5)
    for run in ranks:
        assert run["graphs"] == 1
        for name, want in model.named_parameters():
            got = run["weights"][name]
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, name
