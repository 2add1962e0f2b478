"""ORTModule: a torch.nn.Module whose forward runs an ONNX Runtime graph and whose backward (through
torch.autograd) runs that graph's gradient, for any torch training loop.

The wrapper shares the model's tables of parameters, buffers and submodules, so every nn.Module
API sees the model's own names and tensors: `parameters()` for any torch optimizer, `state_dict()`
keys that load into the plain model, `.to()`, DistributedDataParallel's gradient hooks (autograd
accumulates the graph's gradients into `.grad`). Other attributes are the model's.
"""
import functools
import types
import warnings
import weakref

import torch

from .._compile.cache import GraphCache
from .._compile.module_graph import ModuleGraph
from .._configuration.ortmodule_settings import FallbackPolicy, settings
from .._configuration.runtime_settings import RuntimeSettings
from .._export.batch_norm import sync_batch_norm_refused, untracked_changes
from .._export.binding import BindingError, bind_call
from .._export.guards import DataDependentTraceError, ModuleState
from .._export.outputs import OutputSchema
from .._export.probe import custom_functions, custom_functions_refused, layerdrop_refused, probe_call
from .._graph.autocast import slower_than_fp32, unsupported
from .._runtime.placement import Placement
from .._runtime.sessions import Sessions

MAX_CACHED_GRAPHS = 8  # as ORTTrainer's utils.max_cached_graphs default
_SHARED_TABLES = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")
_OWN = frozenset(("training", "_original_module", "_settings", "_graphs", "_sessions", "_state",
                  "forward"))  # a forward set on the wrapper (accelerate's autocast) is the wrapper's
_PYTORCH = "run the PyTorch model"  # a signature whose graph could not be compiled (fallback)
_LIBRARIES = ("torch.", "transformers.")  # the packages whose model methods stay the model's


class ORTModule(torch.nn.Module):
    """Wraps `module` so that its forward and backward run in ONNX Runtime.

    `model = ORTModule(model)` and the rest of the PyTorch loop stays: any torch optimizer, LR
    scheduler, `clip_grad_norm_`, `DistributedDataParallel(ORTModule(model))`, autocast around the
    loss, `state_dict()` (the model's keys), `torch.save`. Inputs are passed as `module.forward`
    takes them (tensors by position or keyword; other arguments are constants of the call); any
    tensor outputs come back in the structure forward() returns (tuples, dicts, ModelOutputs).

    Each input signature (shapes, dtypes, device, which inputs and parameters require grad, the
    constants and the structure of list, tuple and dict arguments, grad mode, autocast) and model
    state (train/eval flags, hooks, plain attributes: `_export.guards.ModuleState`) gets its own graph,
    compiled on its first call (a bounded cache of MAX_CACHED_GRAPHS); a trace whose Python code
    read tensor values runs in PyTorch instead. A call with gradients runs ONNX
    Runtime's forward and keeps its state; `backward()` runs the gradient graph from it (nothing
    is recomputed). A call without (`torch.no_grad()`, nothing requires grad) runs the forward
    graph alone.

    BatchNorms in training mode normalize with the batch statistics, which the graph also returns:
    their running statistics are updated after each call in training mode, as torch's forward does.
    Where a graph cannot be compiled (the export fails, an op has no gradient in ONNX Runtime, the
    model changes other buffers in its forward, an unsupported device), that signature runs the PyTorch
    model instead, with a warning naming the cause; ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE
    raises the error instead. `debug_options`: a DebugOptions (logging, saving the ONNX models).
    """

    def __new__(cls, module=None, *args, **kwargs):
        """`ORTModule(model)` is an instance of `_class_for(type(model))`: ORTModule with the model's
        forward() signature (transformers.Trainer keeps the dataset columns `model.forward` names
        and reads the label names from `type(model).forward`)."""
        if cls is ORTModule and isinstance(module, torch.nn.Module):
            cls = _class_for(type(module))
        return super().__new__(cls)

    def __init__(self, module, debug_options=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule: module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, (ORTModule, torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            raise TypeError(f"ORTModule: module must be the model itself, got a {type(module).__name__}; wrap the "
                            "model first: DistributedDataParallel(ORTModule(model)) (DataParallel is not supported)")
        own_settings = settings(debug_options)
        super().__init__()
        for table in _SHARED_TABLES:
            object.__setattr__(self, table, getattr(module, table))
        object.__setattr__(self, "_original_module", module)
        self._settings = own_settings
        self._graphs = GraphCache(MAX_CACHED_GRAPHS)
        self._sessions = {}  # torch device -> the Sessions of its Placement
        self._state = ModuleState(module)
        self.training = module.training

    @property
    def __class__(self):
        """The model's class, so that `isinstance(ORTModule(model), type(model))` holds: libraries
        that tell models apart by class treat the wrapper as the model (transformers.Trainer saves
        a PreTrainedModel with its `save_pretrained`: tied weights once, as safetensors requires;
        accelerate does not unwrap an ORTModule). `type()` and `isinstance(..., ORTModule)` see
        the wrapper."""
        model = self.__dict__.get("_original_module")
        return type(self) if model is None else model.__class__

    @property
    def module(self):
        """The wrapped model (as the original ORTModule)."""
        return self._original_module

    def _get_name(self):
        """The model's class name: what tools that ask a module its kind read (transformers.Trainer
        shifts the labels it smooths for causal language models, known by that name)."""
        return self._original_module._get_name()

    # ---------------------------------------------------------------- the model's, not ours
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_original_module" not in self.__dict__:
                raise
            value = getattr(self._original_module, name)
        if _is_model_method(value, self._original_module):
            return types.MethodType(value.__func__, self)  # its self(...) calls run the graph
        return value

    def __setattr__(self, name, value):
        if name in _SHARED_TABLES and "_original_module" in self.__dict__:
            kind = type(value)
            raise NotImplementedError(
                f"ORTModule: its {name} table cannot be replaced (got a {kind.__module__}.{kind.__qualname__}): it is "
                "the model's. DeepSpeed ZeRO stage 3 replaces it to partition the parameters and gather them in each "
                "submodule's forward hooks, which an ONNX Runtime graph (one run over all parameters, no submodule "
                "forward) does not call: use ZeRO stage 1 or 2 with ORTModule, or ZeRO stage 3 on the plain model")
        if name in _OWN or "_original_module" not in self.__dict__:
            super().__setattr__(name, value)
        else:
            setattr(self._original_module, name, value)

    def train(self, mode=True):
        if not isinstance(mode, bool):
            raise ValueError(f"ORTModule.train: mode must be a bool, got {mode!r}")
        self._original_module.train(mode)
        self.training = mode
        return self

    def apply(self, fn):
        self._original_module.apply(fn)
        return self

    def state_dict(self, *args, **kwargs):
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _replicate_for_data_parallel(self):
        raise TypeError("ORTModule does not support torch.nn.DataParallel (its replicas would share one model); "
                        "use DistributedDataParallel(ORTModule(model))")

    def __getstate__(self):
        """Compiled graphs hold ONNX Runtime sessions: not pickled, compiled again after a load."""
        state = dict(self.__dict__)
        state["_graphs"], state["_sessions"] = GraphCache(MAX_CACHED_GRAPHS), {}
        return state

    def __reduce_ex__(self, protocol):
        """Pickled (torch.save, copy.deepcopy) by the model's class: the wrapper's class is made per
        model class, so it cannot be pickled by name."""
        model_class = type(self.__dict__.get("_original_module"))
        if type(self) is not _CLASSES.get(model_class):
            return super().__reduce_ex__(protocol)
        return _new_wrapper, (model_class,), self.__getstate__()

    # ---------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        model = self._original_module
        try:
            binding, values = bind_call(model, args, kwargs)
            named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            key = self._signature(binding, values, named)
        except BindingError as error:
            return self._fall_back(FallbackPolicy.FALLBACK_UNSUPPORTED_DATA, error, args, kwargs)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._compile(binding, values, named, needs_grad=key[-1])
            key = self._signature(binding, values, named)  # without attributes the probe saw forward() write
            self._graphs.put(key, graph)
        if graph is _PYTORCH:
            return model(*args, **kwargs)
        feeds = graph.feeds(values, named)
        outputs = _GraphFunction.apply(graph, *feeds) if graph.trains else graph.infer(feeds)
        graph.batch_statistics.update(outputs)  # training-mode BatchNorms: their running statistics, as torch
        return graph.schema.rebuild(outputs)

    def _signature(self, binding, values, named):
        """What one compiled graph serves; the last item says whether the call needs gradients."""
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*values.values(), *named.values()))
        inputs = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in values.items())
        constants = tuple((name, type(value), value) for name, value in binding.constant_keywords.items())
        structures = tuple((name, structure.key) for name, structure in binding.structures.items())
        model = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in named.items())
        key = (inputs, binding.positional, constants, structures, model, self._state.read(), _autocast(), needs_grad)
        try:
            hash(key)
        except TypeError:
            arguments = {**binding.constant_keywords, **{name: key for name, key in structures}}
            unhashable = [name for name, value in arguments.items() if not _hashable(value)]
            raise BindingError(f"arguments {unhashable} of forward{binding.signature} are constants of the call that "
                               "cannot be compared with those of other calls (unhashable)") from None
        return key

    def _compile(self, binding, values, named, needs_grad):
        """The graph of a new signature, or _PYTORCH when it cannot be compiled and the fallback
        policy allows it. The model's own errors (its forward fails in PyTorch) propagate."""
        model = self._original_module
        before = self._state.read()
        output, changed = probe_call(model, binding, values, grad=needs_grad)
        self._state.forgets(before, self._state.read())
        kind = FallbackPolicy.FALLBACK_UNSUPPORTED_DATA
        try:
            tensors = []
            schema = OutputSchema(output, tensors)
            functions = custom_functions(tensors, values.values())
            del output, tensors  # and the autograd graph of the probe
            kind = FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL
            synchronized = sync_batch_norm_refused(model, "it runs in PyTorch under the default fallback policy")
            if synchronized is not None:
                raise synchronized
            changed = untracked_changes(model, changed)  # BatchNorm running statistics: updated after each call
            if changed:
                raise NotImplementedError(f"the model changes buffers {changed} in its forward, which an ONNX Runtime "
                                          "graph cannot write back (BatchNorm running statistics excepted)")
            if functions:
                raise custom_functions_refused(functions, "they run in PyTorch under the default fallback policy")
            layerdrop = layerdrop_refused(model)
            if layerdrop is not None:
                raise layerdrop
            kind = FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE
            sessions = self._sessions_of(values, named)
            compute_dtype = _compute_dtype(sessions.placement.ort_device)
            kind = FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL
            return ModuleGraph(model, binding, values, schema, sessions, self._settings, needs_grad,
                               compute_dtype=compute_dtype)
        except Exception as error:
            if isinstance(error, DataDependentTraceError):
                kind = FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL
            if not self._settings.falls_back(kind):
                raise
            self._warn(kind, error)
            return _PYTORCH

    def _sessions_of(self, values, named):
        """The Sessions of the device the model and inputs are on (one per device)."""
        device = next((t.device for t in (*named.values(), *values.values())), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"ONNX Runtime does not run on torch device {device}")
        if device not in self._sessions:
            runtime = RuntimeSettings(device=str(device), threads=torch.get_num_threads(),
                                      log_severity=int(self._settings.ort_severity))
            self._sessions[device] = Sessions(Placement(str(device)), runtime)
        return self._sessions[device]

    def _fall_back(self, kind, error, args, kwargs):
        """A call the graph cannot take: PyTorch runs it if the policy allows, else the error."""
        if not self._settings.falls_back(kind):
            raise error
        self._warn(kind, error)
        return self._original_module(*args, **kwargs)

    def _warn(self, kind, error):
        warnings.warn(f"ORTModule: {type(self._original_module).__name__} runs in PyTorch for this input signature "
                      f"({kind.name}): {type(error).__name__}: {error}. Set ORTMODULE_FALLBACK_POLICY="
                      "FALLBACK_DISABLE to raise instead", UserWarning, stacklevel=6)  # the caller of model(...)


_CLASSES = weakref.WeakKeyDictionary()  # model class -> its ORTModule class


def _class_for(model_class):
    """ORTModule's subclass for models of `model_class`, named ORTModule, whose `forward` has the
    model's signature: tools that inspect the class (transformers.Trainer's `find_labels` and
    `can_return_loss` read `type(model).forward`) see the model's parameters, not `(*args, **kwargs)`."""
    cls = _CLASSES.get(model_class)
    if cls is None:
        @functools.wraps(model_class.forward)
        def forward(self, *args, **kwargs):
            return ORTModule.forward(self, *args, **kwargs)

        cls = type(ORTModule)(ORTModule.__name__, (ORTModule,), {
            "forward": forward, "__module__": ORTModule.__module__, "__qualname__": ORTModule.__qualname__,
            "__doc__": ORTModule.__doc__})
        _CLASSES[model_class] = cls
    return cls


def _new_wrapper(model_class):
    """Unpickling: an empty ORTModule of `model_class`'s wrapper class (__setstate__ fills it)."""
    return torch.nn.Module.__new__(_class_for(model_class))


def _is_model_method(value, model):
    """Whether `value` is a method the model's own classes define, such as a train_step- or
    generate-style helper: bound to the wrapper instead, its `self(...)` calls run the graph, as
    in the original ORTModule. Methods of the libraries' base classes (nn.Module's, Hugging Face's
    `save_pretrained` or `generate`) stay the model's: they act on the model itself (its class
    name in a saved config, its PyTorch forward for generation with a cache). So does a method
    that calls zero-argument `super()`: it needs the model as `self`."""
    if not isinstance(value, types.MethodType) or value.__self__ is not model:
        return False
    function, code = value.__func__, getattr(value.__func__, "__code__", None)
    return (not getattr(function, "__module__", "").startswith(_LIBRARIES)
            and (code is None or "__class__" not in code.co_freevars))


def _compute_dtype(device_type):
    """The mixed-precision compute type of a call on `device_type` under torch.autocast
    ('float16', 'bfloat16'), or None outside autocast. Raises NotImplementedError where the
    device cannot compute in it (the call then runs in PyTorch under the default fallback policy);
    warns where it is slower than fp32."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    reason = unsupported(device_type, dtype)
    if reason is not None:
        raise NotImplementedError(f"torch.autocast({device_type!r}, {dtype}): {reason}")
    slower = slower_than_fp32(device_type, dtype)
    if slower is not None:
        warnings.warn(f"ORTModule under torch.autocast({device_type!r}, {dtype}): {slower}")
    return dtype


def _autocast():
    """The autocast state: part of a graph's key (a call under autocast computes in its type)."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


def _hashable(value):
    try:
        hash(value)
    except TypeError:
        return False
    return True


class _GraphFunction(torch.autograd.Function):
    """Autograd's view of one graph call: forward in ONNX Runtime, backward from its kept state.

    Inputs: the graph, then its feeds (the call's tensors, the parameters and buffers). The feeds
    that require grad get the backward's gradients, except those the outputs that received one do
    not depend on (None, as torch leaves them, not zeros an optimizer would step on); outputs ONNX
    Runtime marks non-differentiable are so for torch too. The feeds, and the outputs whose memory
    the backward reads, are saved (not copied: ONNX Runtime's state reads their memory in the
    backward), so that changing one in place before backward() is torch's error, not a wrong
    gradient. ONNX Runtime frees the forward's state in the backward: a second backward (after
    retain_graph=True) is refused, not run on freed memory."""

    @staticmethod
    def forward(ctx, graph, *feeds):
        outputs, ctx.state = graph.run_forward(feeds)
        ctx.graph = graph
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in outputs]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*feeds, *(outputs[index] for index in graph.read_by_backward))
        ctx.mark_non_differentiable(*(outputs[index] for index in graph.non_differentiable))
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *output_grads):
        graph = ctx.graph
        ctx.saved_tensors  # raises if a feed was changed in place since the forward
        if ctx.state is None:
            raise RuntimeError("ORTModule: a second backward through the outputs of one call is not supported: ONNX "
                               "Runtime frees the call's forward state in the first backward, which retain_graph=True "
                               "does not keep. Sum the losses and call backward() once, or call the model again for "
                               "each backward")
        grads = []
        for index, (grad, (shape, dtype, device)) in enumerate(zip(output_grads, ctx.outputs)):
            if index in graph.non_differentiable:
                continue
            if grad is None:  # an output the loss does not use: zeros (a scalar where ONNX Runtime adds it)
                grad = torch.zeros(shape if index in graph.full_shape_grads else (), dtype=dtype, device=device)
            grads.append(grad)
        state, ctx.state = ctx.state, None  # the forward's activations go as soon as the backward is done
        used = {index for index, grad in enumerate(output_grads) if grad is not None}
        return (None, *graph.run_backward(state, grads, used))
