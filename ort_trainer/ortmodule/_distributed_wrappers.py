"""How ORTModule meets the wrappers of distributed training that it does not run inside: DataParallel
(refused: its replicas would share one model and its graphs), FSDP2's DTensor parameters, and tables
replaced by DeepSpeed ZeRO-3 (accepted where they hold the same entries)."""
import sys

import torch


def same_entries(table, current):
    """Whether `table` is a table (dict, set) holding what `current` holds (by identity). Read as a
    plain dict: DeepSpeed's ZeROOrderedDict gathers a partitioned parameter when indexed."""
    if isinstance(current, dict):
        theirs, ours = dict(dict.items(table)) if isinstance(table, dict) else None, dict(dict.items(current))
        return theirs is not None and theirs.keys() == ours.keys() and all(theirs[k] is v for k, v in ours.items())
    return isinstance(table, set) and table == current


DATA_PARALLEL_REFUSED = ("ORTModule does not support torch.nn.DataParallel (its replicas would share one model and "
                         "its ONNX Runtime graphs): use DistributedDataParallel(ORTModule(model)), one process per "
                         "GPU (torchrun)")
_DATA_PARALLEL_FORWARD = torch.nn.DataParallel.forward.__code__


def called_by_data_parallel(module):
    """Whether a torch.nn.DataParallel with devices (on CUDA) is calling `module` or a model holding
    it: with one device it calls the module without replicating it (`_replicate_for_data_parallel`
    sees only several). Without devices (on the CPU) DataParallel calls the model as it is."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _DATA_PARALLEL_FORWARD:
            parallel = frame.f_locals.get("self")
            if getattr(parallel, "device_ids", None) and any(child is module for child in parallel.module.modules()):
                return True
        frame = frame.f_back
    return False


def is_dtensor(tensor):
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return tensor_module is not None and isinstance(tensor, tensor_module.DTensor)
