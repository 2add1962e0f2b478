"""The kernels of the bf16 product torch nodes (`_graph.bf16_products`): fp32 in, bf16 compute
(torch's kernels accumulate in fp32), fp32 out, as torch.autocast's bf16 ops and their autograd;
and of the fp32 products moved to torch where its kernel is faster (`matrix_product`); the bf16
loss's kernels (`log_softmax_fp32`, `softmax_grad_to_bf16`: a block of rows at a time).

One gradient node computes every wanted operand's gradient from the output gradient, cast to
bf16 once, and the factors' bf16 copies the forward read (`TO_BF16` nodes': no operand converted
again, no forward recomputed): each gradient costs one product, as in torch's backward. Batched operands that
broadcast are summed back to their shape; a weight multiplied by a batch of rows gets one product
over all the rows, as torch's linear computes it.
"""
import contextlib
import math

import torch

from .._graph.bf16_products import scaled_in_fp32
from .._onnx import in_operand_order
from .cpu_buffers import bound_output, converted, empty, output

_BF16 = torch.bfloat16


def _transposed(tensor, flag):
    return tensor.mT if flag else tensor


def convolution_args(weight, params):
    """stride, padding, dilation, transposed, output_padding, groups: ONNX's defaults filled in."""
    dims = weight.dim() - 2
    stride, padding, dilation, output_padding = (params[key] or [default] * dims for key, default in (
        ("stride", 1), ("padding", 0), ("dilation", 1), ("output_padding", 0)))
    return stride, padding, dilation, params["transposed"], output_padding, params["groups"]


def product(inputs, params):
    """The forward, its result in fp32 (in bf16 where `output_bf16`: a loss reads it or it is returned in bf16,
    `_graph.bf16_products.bf16_logits_into_loss`, `bf16_outputs_from_products`): the operands (fp32, in the
    node's order), then the bf16 copies of the
    two factors (`TO_BF16` nodes'), which it computes with; a third operand (a bias) cast to bf16 here."""
    count = len(params["operands"])
    operands = [*inputs[count:], *(tensor.to(_BF16) for tensor in in_operand_order(inputs[:count], params)[2:])]
    result = _bf16_product(operands, params)
    if params.get("output_bf16"):
        return [result]
    result = converted(result, torch.float32)
    return [result * params["alpha"] if scaled_in_fp32(params) else result]


def _bf16_product(operands, params):
    """The product of bf16 `operands` in bf16 (the alpha of a product without a third operand not
    applied: it scales in fp32)."""
    if params["kind"] == "convolution":
        bias = operands[2] if len(operands) > 2 else None
        return torch.ops.aten.convolution(operands[0], operands[1], bias, *convolution_args(operands[1], params))
    a, b = _transposed(operands[0], params["trans_a"]), _transposed(operands[1], params["trans_b"])
    if params["kind"] == "gemm" and len(operands) > 2:
        return torch.addmm(operands[2], a, b, beta=params["beta"], alpha=params["alpha"],
                           **_into((a.shape[0], b.shape[1]), operands))
    if len(operands) > 2:  # a MatMul and the bias Add after it (alpha 1): as torch's linear adds it
        if b.dim() == 2 and a.dim() >= 2:
            rows = a.reshape(-1, a.shape[-1])
            rows = torch.addmm(operands[2], rows, b, **_into((rows.shape[0], b.shape[1]), operands))
            return rows.reshape(*a.shape[:-1], b.shape[-1])
        return torch.matmul(a, b) + operands[2]
    return torch.matmul(a, b)


def _into(shape, operands):
    """`out=` a pooled bf16 buffer (`cpu_buffers`), unless autograd records the product (tests)."""
    if torch.is_grad_enabled() and any(operand.requires_grad for operand in operands):
        return {}
    return {"out": empty(shape, _BF16)}


def product_gradients(inputs, params):
    """The gradients of the operands `params['wanted']` lists (the torch node's input order), in
    fp32, from the output's gradient (inputs[0], fp32 or bf16: cast once for all of them), the
    factors' bf16 copies the forward read (inputs[1], inputs[2]) and, with a third operand, that
    operand (for its shape): what torch's autograd of `product` gives, each gradient one bf16
    product."""
    grad, factors = inputs[0], list(inputs[1:3])
    shapes = [factor.shape for factor in factors] + [operand.shape for operand in inputs[3:]]
    wanted = [params["operands"][k] for k in params["wanted"]]
    if params["kind"] == "convolution":
        mask = [k in wanted for k in range(3)]
        bias_sizes = [shapes[2][0]] if len(shapes) > 2 else None
        found = torch.ops.aten.convolution_backward(grad.to(_BF16), *factors, bias_sizes,
                                                    *convolution_args(factors[1], params), mask)
        return [found[k].float() for k in wanted]
    in_bf16 = params["kind"] == "gemm" and len(shapes) > 2  # addmm scales in bf16, matmul's alpha is fp32
    alpha = params["alpha"] if in_bf16 else 1.0
    grad = converted(grad if in_bf16 or params["alpha"] == 1.0 else grad.float() * params["alpha"], _BF16)
    return [converted(_operand_gradient(grad, factors, shapes, k, params, alpha), torch.float32) for k in wanted]


def _operand_gradient(grad, factors, shapes, operand, params, alpha):
    """The bf16 gradient of operand `operand` (op order) from the bf16 output gradient."""
    if operand == 2:  # Gemm's C, added as beta * C, or the bias added to a MatMul
        beta = params.get("beta", 1.0)
        return (grad * beta if beta != 1.0 else grad).sum_to_size(shapes[2])
    a, b = _transposed(factors[0], params["trans_a"]), _transposed(factors[1], params["trans_b"])
    shape = shapes[operand]
    if a.dim() < 2 or b.dim() < 2:
        result = _vector_product_gradient(grad, a, b, operand)
    elif operand == 0:  # of op(A): grad @ op(B)^T
        result = _rows_product(b.mT, grad.mT, shape) if params["trans_a"] else _rows_product(grad.mT, b.mT, shape)
    else:  # of op(B): op(A)^T @ grad
        result = _rows_product(grad, a, shape) if params["trans_b"] else _rows_product(a, grad, shape)
    return result * alpha if alpha != 1.0 else result


def _rows_product(left, right, shape):
    """left^T @ right summed to `shape`: one product over all the rows of a batch when the result
    is a matrix (a weight's gradient, as torch's linear and matmul compute it)."""
    if len(shape) == 2 and left.dim() > 2 and left.shape[:-1] == right.shape[:-1]:
        return left.reshape(-1, left.shape[-1]).mT.mm(right.reshape(-1, right.shape[-1]))
    return (left.mT @ right).sum_to_size(shape)


def _vector_product_gradient(grad, a, b, operand):
    """A product with a 1-d operand: torch's autograd of the bf16 matmul (transposes do not apply)."""
    operands = [a.detach(), b.detach()]
    operands[operand].requires_grad_(True)
    with torch.enable_grad():
        result = torch.matmul(*operands)
    return torch.autograd.grad(result, operands[operand], grad)[0]


def matrix_product(inputs, params):
    """An fp32 product in ONNX Gemm's terms (`_graph.cpu_products`): alpha op(A) op(B) + beta C,
    the transposes read as views; an A of more than two dims is a batch of rows (untransposed),
    multiplied as one matrix of all its rows. Written into the caller's bound buffer where the
    result is a graph output, else a pooled one (`cpu_buffers`: a vocabulary projection's 32 MiB
    result into fresh memory paid a page fault per 4 KiB)."""
    a, b = _transposed(inputs[0], params["trans_a"]), _transposed(inputs[1], params["trans_b"])
    rows = a.shape[:-1]
    a = a.reshape(-1, a.shape[-1])
    result = output(params, 0, (a.shape[0], b.shape[1]), torch.float32, inputs)
    if len(inputs) > 2:
        torch.addmm(inputs[2], a, b, beta=params["beta"], alpha=params["alpha"], out=result)
    else:
        torch.mm(a, b, out=result)
        if params["alpha"] != 1.0:
            result.mul_(params["alpha"])
    return [result.view(*rows, result.shape[-1])]


_ROWS = 32  # rows of a logits-sized tensor converted at a time: in cache until they are used


def softmax_grad_to_bf16(inputs, params):
    """The softmax cross-entropy's gradient (`_graph.cpu_kernels`' Exp, ScatterElements and Mul) written
    in bf16: exp(log_prob), each row's label entry set to its gradient (prob - 1), scaled per row,
    in fp32 a block of rows at a time (no logits-sized fp32 tensor) and rounded as stored.
    A fifth input, the bf16 gradient of an output these values are also the gradient of (ORTModule's
    returned logits), is added in bf16 as autocast's autograd sums two bf16 gradients: of the
    result's size (in any shape), or a scalar (an unused output's zero adds nothing)."""
    return [_softmax_gradient(inputs, torch.bfloat16, "softmax_grad_to_bf16")]


def softmax_grad(inputs, params):
    """The same gradient in fp32 (`_graph.loss_gradient`), computed in the result's memory, in place
    of ONNX Runtime's Exp, Mul and, for ORTModule's returned logits, the Add of their gradient (a
    scalar zero when the user's loss did not read them: nothing added). 6.9 ms against 12.5 through
    a block of rows on [512, 32,000] (this 2-core Xeon)."""
    return [_softmax_gradient(inputs, torch.float32, "softmax_grad")]


def _softmax_gradient(inputs, dtype, name):
    log_prob, index, at_label, row_scale, *added = inputs
    result = empty(log_prob.shape, dtype)
    added = _added_gradient(added[0], log_prob.shape, name) if added else None
    if dtype == torch.float32:  # in the result's own memory, whole: three passes, no second buffer
        torch.exp(log_prob, out=result).scatter_(1, index, at_label).mul_(row_scale)
        return result if added is None else result.add_(added)
    block = empty((min(_ROWS, log_prob.shape[0]), *log_prob.shape[1:]), torch.float32)
    for start in range(0, log_prob.shape[0], _ROWS):
        stop = min(start + _ROWS, log_prob.shape[0])
        rows = torch.exp(log_prob[start:stop], out=block[:stop - start])
        torch.mul(rows.scatter_(1, index[start:stop], at_label[start:stop]), row_scale[start:stop],
                  out=result[start:stop])
        if added is not None:
            result[start:stop].add_(added[start:stop])
    return result


def _added_gradient(gradient, shape, name):
    """`gradient` as added to a result of `shape` (`softmax_grad_to_bf16`, `softmax_grad`): None for a
    scalar zero."""
    if gradient.dim() == 0:
        return gradient.expand(shape) if bool(gradient) else None
    if gradient.numel() != math.prod(shape):
        raise ValueError(f"{name}: a gradient of shape {list(gradient.shape)} added to a result of shape "
                         f"{list(shape)}: it must have the result's size or be a scalar")
    return gradient.reshape(shape)


def log_softmax_fp32(inputs, params):
    """log_softmax of bf16 logits computed in fp32 (the values of the fp32 logits' log_softmax),
    a block of rows at a time along dim 0 (the classes' axis must be another)."""
    logits, axis = inputs[0], params["axis"]
    result = empty(logits.shape, torch.float32)
    if logits.dim() < 2 or axis % logits.dim() == 0:
        return [torch.log_softmax(logits.float(), axis, out=result)]
    for start in range(0, logits.shape[0], _ROWS):
        torch.log_softmax(logits[start:start + _ROWS].float(), axis, out=result[start:start + _ROWS])
    return [result]



def rows_added(inputs, params):
    """A weight's gradient with an embedding's rows added (`_graph.tied_embedding_gradient`): the
    dense gradient (inputs[0]; copied into the caller's bound buffer of the result where there is
    one, else written into where `in_place`: a torch node's output nothing else reads), then
    `rows[k]` added to row `indices[k]` (indices [N, 1], negative ones counted from the end, as
    GatherNDGrad's). A row looked up more than once gets its rows' sum, added in their
    order, then added to the dense gradient: the values of the Sum it replaces."""
    dense, indices, rows = inputs
    bound = bound_output(params, 0, dense.shape, dense.dtype, inputs)
    if bound is not None:
        result = bound.copy_(dense)
    elif params["in_place"]:
        result = dense
    else:
        result = empty(dense.shape, dense.dtype).copy_(dense)
    with _one_thread():
        index = indices.reshape(-1)
        index = torch.where(index < 0, index + result.shape[0], index)
        rows = rows.reshape(index.shape[0], -1).to(result.dtype)
        unique, position = torch.unique(index, return_inverse=True)
        summed = torch.zeros((unique.shape[0], rows.shape[1]), dtype=result.dtype).index_add_(0, position, rows)
        result.view(result.shape[0], -1).index_add_(0, unique, summed)
    return [result]


@contextlib.contextmanager
def _one_thread():
    """torch's kernels single-threaded within: for a few hundred rows' adds, where index_add_ opens
    a parallel region per row and each waits for every OpenMP worker: 0.4 ms on a quiet 2-core
    machine, 60 ms while another process held one of its cores (0.12 ms single-threaded)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
