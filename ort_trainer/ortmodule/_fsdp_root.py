"""ORTModule around a model FSDP2's `fully_shard` sharded already: `ORTModule(fully_shard(model))`.

FSDP puts two hooks on the model it shards: before a call, one gathers the parameters (the model's
tables then hold them whole, as plain tensors) and after it, the other registers on the outputs what
the backward needs (gather again where they were freed; reduce-scatter the gradients at its end). They
run around the whole ORTModule call, as they do around `fully_shard(ORTModule(model))`, and are kept
out of the model's hook tables meanwhile: inside, the trace and a fallback call the model itself, and
the graph reads the gathered parameters. Submodules sharded on their own are refused: their hooks
would run inside the traced forward."""
import contextlib
import sys


def fsdp_state(module):
    """The FSDP2 state of `module` when `fully_shard` was applied to it, else None."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # nothing is sharded before it is imported
    return module._get_fsdp_state() if fsdp is not None and isinstance(module, fsdp.FSDPModule) else None


def sharded_submodules(module):
    """Names of the submodules of `module` (itself excepted) that `fully_shard` was applied to."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [name for name, child in module.named_modules() if child is not module and isinstance(child, fsdp.FSDPModule)]


def nested_refusal(module, nested):
    return TypeError(
        f"ORTModule: submodules {nested} of the {type(module).__name__} are sharded by FSDP2's fully_shard on their "
        "own, and their hooks would run inside the graph's traced forward: shard the model as a whole "
        "(ORTModule(fully_shard(model))), or wrap each block before sharding it: fully_shard(ORTModule(block))")


def call_between_hooks(module, state, call, args, kwargs):
    """`call(args, kwargs)` between FSDP's forward hooks of `module` (run as torch's Module.__call__
    runs them), with those hooks out of the module's tables while it runs."""
    with _hooks_out(module, state) as (pre_hooks, post_hooks):
        for hook in pre_hooks:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        output = call(args, kwargs)
        for hook in post_hooks:
            result = hook(module, args, output)
            output = output if result is None else result
        return output


@contextlib.contextmanager
def _hooks_out(module, state):
    """Takes FSDP's hooks (bound methods of `state`) out of `module`'s forward hook tables, yields
    them (pre-hooks, hooks) and puts them back where they were."""
    tables = (module._forward_pre_hooks, module._forward_hooks)
    saved = [list(table.items()) for table in tables]
    taken = [[hook for _, hook in items if getattr(hook, "__self__", None) is state] for items in saved]
    for table, items in zip(tables, saved):
        for key, hook in items:
            if getattr(hook, "__self__", None) is state:
                del table[key]
    try:
        yield taken
    finally:
        for table, items in zip(tables, saved):
            added = [(key, hook) for key, hook in table.items() if key not in dict(items)]
            table.clear()
            table.update(items)
            table.update(added)
