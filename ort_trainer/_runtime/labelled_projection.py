"""The kernels of a vocabulary projection whose scores a model returns while its loss reads only the
labelled rows (`_graph.label_sparsity`'s LABELLED_PROJECTION node and its gradient node).

Why a torch node: whether the projection's gradients can skip the ignored rows depends on the
returned scores' gradient, known only when the backward runs. ORTModule feeds a scalar zero for an
output the user's loss did not use (`_compile.module_compiler.ModuleGraph.zero_gradient`; a Hugging
Face model's logits, usually): then the input's, weight's and bias's gradients are products over
the kept rows only, as the dense graph's are over rows whose gradient is zero elsewhere. A
gradient of the scores' shape (a loss of the user's that reads the logits too) is added to the
loss's, scattered to its rows, and the gradients are the dense products. Both are what the dense
graph computes, to float rounding.

Operands in op order (`params['operands']` lists them reordered, `_onnx.in_operand_order`): the
projection's input ([..., width]: its rows flattened), its weight ([width, classes], or
[classes, width] with `trans_b`), the kept rows (int64 positions in the flattened rows, each once), and an
optional per-class bias; `alpha` scales the product and `beta` the bias, as ONNX's Gemm.
"""
import torch

from .._onnx import in_operand_order
from .cpu_buffers import empty, output


def _empty(shape, like):
    """A float32 tensor of `shape` on `like`'s device (a pooled buffer on the CPU: `cpu_buffers`)."""
    if like.device.type == "cpu":
        return empty(shape, torch.float32)
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def _factors(inputs, params):
    """(the input's rows [rows, width], the weight as [width, classes], the kept rows, the bias or None)."""
    hidden, weight, rows, *bias = in_operand_order(inputs, params)
    return (hidden.reshape(-1, hidden.shape[-1]), weight.mT if params["trans_b"] else weight, rows,
            bias[0] if bias else None)


def labelled_projection(inputs, params):
    """[the scores of every row, in the input's leading dims (into the caller's bound buffer of the
    fetched logits where there is one); the kept rows' scores, [kept, classes]]."""
    flat, weight, rows, bias = _factors(inputs, params)
    shape = (flat.shape[0], weight.shape[1])
    scores = output(params, 0, shape, torch.float32, inputs) if flat.device.type == "cpu" else _empty(shape, flat)
    if bias is not None:
        torch.addmm(bias, flat, weight, beta=params["beta"], alpha=params["alpha"], out=scores)
    else:
        torch.mm(flat, weight, out=scores)
        if params["alpha"] != 1.0:
            scores.mul_(params["alpha"])
    leading = in_operand_order(inputs, params)[0].shape[:-1]
    kept = torch.index_select(scores, 0, rows, out=_empty((rows.shape[0], scores.shape[1]), flat))
    return [scores.view(*leading, scores.shape[1]), kept]


def labelled_projection_grad(inputs, params):
    """The gradients of the operands `params['wanted']` lists (listed order), from the returned
    scores' gradient (inputs[0]: the scores' shape, or 0-d: a scalar zero adds nothing and the
    products run on the kept rows), the kept rows' gradient (inputs[1]) and the forward's inputs."""
    returned, kept, *forward = inputs
    flat, weight, rows, _ = _factors(forward, params)
    hidden = in_operand_order(forward, params)[0]
    if returned.dim() == 0 and not bool(returned):  # unused scores: the kept rows only
        grad, source = kept, flat.index_select(0, rows)
    else:
        dense = returned.expand(flat.shape[0], weight.shape[1]) if returned.dim() == 0 else returned
        if dense.numel() != flat.shape[0] * weight.shape[1]:
            raise ValueError(f"labelled_projection_grad: the returned scores' gradient has shape "
                             f"{list(returned.shape)} for scores of {flat.shape[0]} rows x {weight.shape[1]} classes "
                             "(expected their shape, or a scalar zero)")
        grad = _empty((flat.shape[0], weight.shape[1]), flat).copy_(dense.reshape(flat.shape[0], weight.shape[1]))
        grad, source = grad.index_add_(0, rows, kept), flat
    results = []
    for operand in (params["operands"][k] for k in params["wanted"]):
        if operand == 0:  # the input: grad @ weight^T, written to its rows when they are the kept ones
            found = torch.mm(grad, weight.mT)
            if source is not flat:  # the rows differ from each other (torch's index_add_ is slower here)
                found = torch.zeros_like(flat).index_copy_(0, rows, found)
            results.append(_scaled(found, params["alpha"]).view(hidden.shape))
        elif operand == 1:  # the weight: source^T @ grad, or its transpose
            found = _empty((weight.shape[1], weight.shape[0]) if params["trans_b"] else weight.shape, flat)
            if params["trans_b"]:
                torch.mm(grad.mT, source, out=found)
            else:
                torch.mm(source.mT, grad, out=found)
            results.append(_scaled(found, params["alpha"]))
        else:  # the bias (operand 3; the rows, operand 2, get none)
            results.append(_scaled(grad.sum(0), params["beta"]))
    return results


def _scaled(tensor, factor):
    return tensor.mul_(factor) if factor != 1.0 else tensor
