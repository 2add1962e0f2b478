"""Mixed precision as torch.autocast computes it: the exported fp32 forward rewritten, before ONNX
Runtime's gradient builder, so that the matrix products run in fp16 or bf16 and everything else in
fp32. The weights stay fp32 graph inputs (the flat buffer's master weights); the gradient of a
Cast is a Cast back, so the gradients come out fp32 too.

Which ops run in the lower precision: those of torch.autocast's "lower precision" lists (CPU and
CUDA) that the TorchScript exporter emits as one ONNX op: `aten::linear/matmul/mm/bmm/addmm/
baddbmm` (MatMul, Gemm, and FusedMatMul where ONNX Runtime's optimizer fused a transpose or scale
into one), `aten::conv*` (Conv) and `aten::conv_transpose*` (ConvTranspose).
Their fp32 inputs are cast down and their output cast back to fp32, so the next op (softmax,
layer norm, GELU, residual add, the loss, reductions) computes in fp32, as autocast's fp32 and
promote lists say. Control-flow subgraphs (If/Loop bodies) are left in fp32.

On the CPU the products are emulated: ONNX Runtime's CPU provider has no fp16 or bf16 matrix
products and its cast optimizer folds a `Cast(fp16)` followed by the `Cast(float)` it inserts
around an fp32 kernel, so a real fp16 MatMul would silently compute in fp32. There each input and
the output round-trip through the lower precision (`Cast(fp16)`, `Cast(float)`, which ONNX Runtime
keeps) around an fp32 product: the values autocast's fp16 kernels see and return (fp32
accumulation, as tensor cores and torch's CPU kernels accumulate), gradients included (the
gradient of each round trip is a round trip), at fp32 speed plus the casts. In bf16, on CPUs
with bf16 instructions (AMX or AVX512-BF16), the products run torch's bf16 kernels inside the graph
instead (`_graph.bf16_products`; ONNX Runtime's CPU provider has no bf16 kernel); on others bf16
is refused (`unsupported`): torch's bf16 products are slower than fp32 there.

On CUDA the products run ONNX Runtime's fp16 and bf16 kernels, but for Conv and ConvTranspose in
bf16: ONNX Runtime 1.19's CUDA kernels for those take float, double and float16 only (creating the
session would fail), so they get the CPU's round trips around an fp32 convolution, the values
autocast's bf16 convolution sees and returns (`EMULATED_ON_CUDA`).
"""
from __future__ import annotations

from collections.abc import Collection

import onnx
import torch

from .._onnx import set_nodes
from .bf16_products import products_as_torch_nodes

LOWER_PRECISION_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "FusedMatMul")
COMPUTE_TYPES = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
_FLOAT = onnx.TensorProto.FLOAT
# {dtype: the ops ONNX Runtime's CUDA provider has no kernel for in it}: rounded around an fp32 node there.
EMULATED_ON_CUDA = {"bfloat16": frozenset({"Conv", "ConvTranspose"})}
# Ops whose first output's type is not their first input's (for `element_types`).
_TYPE_CHANGING_OPS = {"Shape", "Size", "Cast", "CastLike", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
                      "Not", "And", "Or", "Xor", "IsNaN", "IsInf", "ArgMax", "ArgMin", "NonZero", "ConstantOfShape",
                      "EyeLike", "RandomNormalLike", "RandomUniformLike", "Multinomial", "QuantizeLinear",
                      "DynamicQuantizeLinear"}


def lower_precision(model: onnx.ModelProto, dtype: str, *, device_type: str | None,
                    differentiable: Collection[str] = ()) -> int:
    """Rewrites `model` (an exported forward, in place): the inputs of each LOWER_PRECISION_OPS
    node that computes in fp32 are cast to `dtype` ('float16' or 'bfloat16'; one cast per tensor,
    shared by its consumers), the node computes in `dtype` and its output is cast back to fp32
    under its old name; on the CPU (`device_type`) bf16 products become torch nodes, the other
    products round trips around the fp32 node, as on CUDA those with no kernel in `dtype`
    (`EMULATED_ON_CUDA`; see the module docstring). `differentiable`: the inputs gradients flow
    from. Returns the number of nodes rewritten."""
    on_cpu = device_type == "cpu"
    emulated_ops = LOWER_PRECISION_OPS if on_cpu else EMULATED_ON_CUDA.get(dtype, frozenset())
    types = element_types(model)
    rewritten = 0
    if on_cpu and dtype == "bfloat16":
        rewritten = len(products_as_torch_nodes(model, lambda node: _computes_in_fp32(node, types),
                                                differentiable=differentiable))
    suffix = f"__{dtype}"
    lowered = {}  # (tensor, emulated) -> its lower-precision copy (emulated: rounded, in fp32)
    nodes = []
    for node in model.graph.node:
        if node.op_type not in LOWER_PRECISION_OPS or not _computes_in_fp32(node, types):
            nodes.append(node)
            continue
        emulated = node.op_type in emulated_ops
        for index in (index for index, name in enumerate(node.input) if name):
            name = node.input[index]
            if (name, emulated) not in lowered:
                lowered[name, emulated] = f"{name}{suffix}_fp32" if emulated else f"{name}{suffix}"
                nodes += _casts(name, lowered[name, emulated], dtype, back=emulated)
            node.input[index] = lowered[name, emulated]
        output = node.output[0]
        node.output[0] = f"{output}{suffix}"
        nodes.append(node)
        nodes += _casts(node.output[0], output, dtype, back=True) if emulated else \
            [onnx.helper.make_node("Cast", [node.output[0]], [output], to=_FLOAT, name=f"{output}_to_float")]
        rewritten += 1
    set_nodes(model.graph, nodes)
    return rewritten


def _casts(source, target, dtype, *, back):
    """`target` = `source` cast to `dtype`; `back`: and cast back to fp32 (a rounding)."""
    if not back:
        return [onnx.helper.make_node("Cast", [source], [target], to=COMPUTE_TYPES[dtype], name=f"{target}_cast")]
    rounded = f"{target}_rounded"
    return [onnx.helper.make_node("Cast", [source], [rounded], to=COMPUTE_TYPES[dtype], name=f"{rounded}_cast"),
            onnx.helper.make_node("Cast", [rounded], [target], to=_FLOAT, name=f"{target}_cast")]


def _computes_in_fp32(node, types):
    """Whether `node` computes in fp32: its inputs share one type (the ops' type constraint), so one
    known fp32 input, and no known input of another type, decides (a contrib op's output may have no
    inferred type)."""
    known = {types[name] for name in node.input if name in types}
    return known == {_FLOAT}


def element_types(model):
    """{tensor name: ONNX element type} of the graph's tensors, by ONNX's type inference; where it
    knows none (ONNX Runtime's fused ops: FusedMatMul, Gelu, LayerNormalization, and what follows
    them), a node's first output has the type of its first input, as those ops' do."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {value.name: value.type.tensor_type.elem_type
             for value in (*graph.input, *graph.value_info, *graph.output) if value.type.HasField("tensor_type")}
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    for node in graph.node:  # in topological order
        if (node.output and node.output[0] not in types and node.input and node.input[0] in types
                and node.op_type not in _TYPE_CHANGING_OPS):
            types[node.output[0]] = types[node.input[0]]
    return types


def cpu_has_bf16_instructions():
    """Whether this CPU multiplies bf16 matrices natively (AMX or AVX512-BF16), as torch detects it."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def unsupported(device_type: str, dtype: str) -> str | None:
    """Why the graphs cannot compute in `dtype` on `device_type` ('cpu', 'cuda'), or None."""
    if device_type == "cpu" and dtype == "bfloat16" and not cpu_has_bf16_instructions():
        return ("this CPU has no bfloat16 instructions (AMX or AVX512-BF16): ONNX Runtime's CPU provider has no "
                "bfloat16 kernels and torch's bf16 matrix products run 15-190x slower than fp32 here (BENCHMARKS.md); "
                "on this CPU train in fp32, or in dtype='float16' for parity checks")
    return None


def slower_than_fp32(device_type: str, dtype: str) -> str | None:
    """Why mixed precision in `dtype` is slower than fp32 on `device_type`, or None."""
    if device_type == "cpu" and dtype == "float16":
        return ("ONNX Runtime's CPU provider has no fp16 matrix products, so they are emulated (fp32 products with "
                "fp16 rounding, as a GPU's fp16 products round): correct, but slower than fp32; mixed precision pays "
                "off on a GPU")
    return None


def cast_outputs(model: onnx.ModelProto, dtypes: dict[str, str]) -> None:
    """Casts the fp32 graph outputs of `model` (in place) that `dtypes` ({output name: 'float16' or
    'bfloat16'}) names to that type: an ORTModule under torch.autocast returns what the model
    returns there (a linear's output in fp16, a loss in fp32)."""
    outputs = {output.name: output for output in model.graph.output}
    for name, dtype in dtypes.items():
        output = outputs[name]
        if output.type.tensor_type.elem_type != _FLOAT:
            continue
        computed = f"{name}__float"
        for node in model.graph.node:
            node.output[:] = [computed if value == name else value for value in node.output]
            node.input[:] = [computed if value == name else value for value in node.input]
        model.graph.node.append(onnx.helper.make_node("Cast", [computed], [name], to=COMPUTE_TYPES[dtype],
                                                      name=f"{name}_to_{dtype}"))
        computed_info = model.graph.value_info.add()  # a torch node's output gets no inferred type
        computed_info.CopyFrom(output)
        computed_info.name = computed
        output.type.tensor_type.elem_type = COMPUTE_TYPES[dtype]
