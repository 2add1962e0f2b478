"""torch.utils.checkpoint while we export: each checkpointed segment traced inline, its nodes named
inside a scope of their own, so that the graph stages can recompute them in the backward
(`_graph.recompute.recompute_segments`) as torch's checkpoint does.

Why patch: the reentrant form runs the segment inside a custom autograd.Function
(`CheckpointFunction`), which a graph would differentiate blindly (the probe refuses custom
Functions); the non-reentrant form traces fine, but nothing in the trace says which nodes it
covered, so the graph kept all their activations. Both forms (and `checkpoint_sequential`, and
Hugging Face's `gradient_checkpointing_enable()`, which binds `functools.partial(checkpoint, ...)`
at import time) go through `torch.utils.checkpoint.checkpoint`, which calls
`CheckpointFunction.apply` or the module's `_checkpoint_without_reentrant_generator`: those two
are replaced, only while tracing. A non-reentrant `context_fn` (selective checkpointing) is not
entered: the whole segment is recomputed, the same values.
"""
import contextlib
import itertools
import re

import torch
import torch.utils.checkpoint as torch_checkpoint

SCOPE = "_checkpoint_"  # an exported node of segment n is named '/.../_checkpoint_<n>/.../<op>'
_SEGMENT = re.compile(rf"(?:^|/){SCOPE}(\d+)/")


def segment_of(node_name):
    """The checkpointed segment (its index in the trace) an exported node was traced in, or None."""
    found = _SEGMENT.findall(node_name)
    return int(found[-1]) if found else None


@contextlib.contextmanager
def checkpoints_inlined():
    """While an export traces: every torch.utils.checkpoint segment runs its function inline (once,
    no autograd.Function, no RNG stash: the graph keeps its random masks) inside scope
    `_checkpoint_<n>`."""
    count = itertools.count()
    reentrant = torch_checkpoint.CheckpointFunction.__dict__.get("apply")
    generator = torch_checkpoint._checkpoint_without_reentrant_generator

    @contextlib.contextmanager
    def scope():
        state = torch._C._get_tracing_state()
        if state is None:  # a run of the exporter's own, untraced: the same values
            yield
            return
        state.push_scope(torch._C._jit_onnx_create_full_scope_name("torch.utils.checkpoint", f"{SCOPE}{next(count)}"))
        try:
            yield
        finally:
            state.pop_scope()

    def apply(function, preserve_rng_state, *args):
        with scope():
            return function(*args)

    def inline(*args, **kwargs):  # checkpoint()'s arguments: the function, its inputs, the options
        with scope():
            yield  # checkpoint() runs the segment's function here

    torch_checkpoint.CheckpointFunction.apply = apply
    torch_checkpoint._checkpoint_without_reentrant_generator = inline
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = generator
        if reentrant is None:
            del torch_checkpoint.CheckpointFunction.apply
        else:
            torch_checkpoint.CheckpointFunction.apply = reentrant
