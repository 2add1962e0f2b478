"""ORTModule's autograd Function: one graph call as torch.autograd sees it."""
import torch


class _GraphFunction(torch.autograd.Function):
    """Autograd's view of one graph call: forward in ONNX Runtime, backward from its kept state.

    Inputs: the graph, what gathers DeepSpeed ZeRO-3's partitioned parameters again for the
    backward (None without), then its feeds (the call's tensors, the parameters and buffers). The feeds
    that require grad get the backward's gradients, except those the outputs that received one do
    not depend on (None, as torch leaves them, not zeros an optimizer would step on); outputs ONNX
    Runtime marks non-differentiable are so for torch too. The feeds, and the outputs whose memory
    the backward reads, are saved (not copied: ONNX Runtime's state reads their memory in the
    backward), so that changing one in place before backward() is torch's error, not a wrong
    gradient. The weights the backward reads are fed to it again (`graph.read_again`), as they
    are then: FSDP2's fully_shard frees the gathered parameters after the forward and gathers them
    again, elsewhere, before the backward, and eager autograd reads a saved parameter as it is
    then. Another feed whose memory moved (a call's input, a weight read inside a subgraph) is
    refused, not read where it was. ONNX Runtime frees the forward's state in the backward: a
    second backward (after retain_graph=True) is refused, not run on freed memory."""

    @staticmethod
    def forward(ctx, graph, gather, *feeds):
        outputs, ctx.state = graph.run_forward(feeds)
        ctx.gather = gather
        ctx.graph, ctx.addresses = graph, [feed.data_ptr() for feed in feeds]
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in outputs]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*feeds, *(outputs[index] for index in graph.read_by_backward))
        ctx.mark_non_differentiable(*(outputs[index] for index in graph.non_differentiable))
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *output_grads):
        graph = ctx.graph
        saved = ctx.saved_tensors  # raises if a feed was changed in place since the forward
        moved = [name for index, (name, feed, address) in enumerate(zip(graph.feed_names, saved, ctx.addresses))
                 if feed.data_ptr() != address and index in graph.read_in_place]
        if moved:
            raise RuntimeError(f"ORTModule: the memory of {moved} moved between the forward and the backward (a "
                               "`.data` assignment), while ONNX Runtime's backward reads them where the forward found "
                               "them. Keep them in place until the backward")
        if ctx.state is None:
            raise RuntimeError("ORTModule: a second backward through the outputs of one call is not supported: ONNX "
                               "Runtime frees the call's forward state in the first backward, which retain_graph=True "
                               "does not keep. Sum the losses and call backward() once, or call the model again for "
                               "each backward")
        grads = []
        for index, (grad, (shape, dtype, device)) in enumerate(zip(output_grads, ctx.outputs)):
            if index in graph.non_differentiable:
                continue
            if grad is None:  # an output the loss does not use
                grad = graph.zero_gradient(index, shape, dtype, device)
            grads.append(grad)
        if ctx.gather is not None:  # DeepSpeed ZeRO-3's partitioned parameters, gathered for the backward
            ctx.gather()
        state, ctx.state = ctx.state, None  # the forward's activations go as soon as the backward is done
        used = {index for index, grad in enumerate(output_grads) if grad is not None}
        return (None, None, *graph.run_backward(state, grads, used, saved[:len(ctx.addresses)]))
