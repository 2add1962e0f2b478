"""ORTModule: a torch.nn.Module whose forward runs an ONNX Runtime graph and whose backward (through
torch.autograd) runs that graph's gradient, for any torch training loop.

The wrapper shares the model's tables of parameters, buffers and submodules, so every nn.Module
API sees the model's own names and tensors: `parameters()` for any torch optimizer, `state_dict()`
keys that load into the plain model, `.to()`, DistributedDataParallel's gradient hooks (autograd
accumulates the graph's gradients into `.grad`). Other attributes are the model's.
"""
import contextlib
import functools
import types
import warnings
import weakref

import torch

from .._compile.cache import GraphCache, ModuleSignature
from .._compile.module_cache import ModuleGraphCache
from .._compile.module_compiler import ModuleGraph
from .._configuration.ortmodule_settings import settings
from .._configuration.refusals import DeviceRefused, TorchModelRefused
from .._configuration.runtime_settings import RuntimeSettings
from .._export.running_statistics import sync_batch_norm_refused, untracked_changes
from .._export.binding import BindingError, bind_call
from .._export.guards import ModuleState
from .._export.outputs import OutputSchema
from .._export.probe import custom_functions, custom_functions_refused, layerdrop_refused, probe_call
from .._graph.autocast import slower_than_fp32, unsupported
from .._runtime.placement import Placement
from .._runtime.sessions import Sessions
from . import _partitioned
from ._density import DensityReport
from ._fallback import REFUSED, handle
from ._distributed_wrappers import DATA_PARALLEL_REFUSED, called_by_data_parallel, is_dtensor, same_entries
from ._fsdp_root import call_between_hooks, fsdp_state, nested_refusal, sharded_submodules
from ._graph_function import _GraphFunction

MAX_CACHED_GRAPHS = 8  # as ORTTrainer's utils.max_cached_graphs default
_SHARED_TABLES = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")
_OWN = frozenset(("training", "_original_module", "_settings", "_graphs", "_sessions", "_state", "_density", "_disk",
                  "forward",  # a forward set on the wrapper (accelerate's autocast) is the wrapper's
                  "__class__"))  # so is a class swapped in (FSDP2's fully_shard)
_PYTORCH = "run the PyTorch model"  # a signature whose graph could not be compiled (fallback)
_LIBRARIES = ("torch.", "transformers.", "peft.")  # the packages whose model methods stay the model's


class ORTModule(torch.nn.Module):
    """Wraps `module` so that its forward and backward run in ONNX Runtime.

    `model = ORTModule(model)` and the rest of the PyTorch loop stays: any torch optimizer, LR
    scheduler, `clip_grad_norm_`, `DistributedDataParallel(ORTModule(model))`, FSDP2's
    `fully_shard(ORTModule(block))`, `deepspeed.initialize(model=ORTModule(model))` at any ZeRO
    stage, autocast around the loss, `state_dict()` (the model's keys), `torch.save`. Inputs are
    passed as `module.forward` takes them (tensors by position or keyword; other arguments are
    constants of the call); any tensor outputs come back in the structure forward() returns (tuples,
    dicts, ModelOutputs).

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
        and reads the label names from `type(model).forward`), deriving from the model's class too."""
        if cls is ORTModule and isinstance(module, torch.nn.Module) and not isinstance(module, _WRAPPERS):
            cls = _class_for(type(module))
        return torch.nn.Module.__new__(cls)

    def __init__(self, module, debug_options=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule: module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, _WRAPPERS):
            raise TypeError(f"ORTModule: module must be the model itself, got a {type(module).__name__}; wrap the "
                            "model first: DistributedDataParallel(ORTModule(model)) (DataParallel is not supported)")
        if nested := sharded_submodules(module):
            raise nested_refusal(module, nested)
        sharded = [name for name, parameter in module.named_parameters() if is_dtensor(parameter)]
        if sharded and fsdp_state(module) is None:
            raise TypeError(f"ORTModule: parameters {sharded} of the {type(module).__name__} are DTensors (sharded by "
                            "FSDP2's fully_shard or tensor parallelism), while the graph reads plain tensors; wrap the "
                            "model before sharding it: fully_shard(ORTModule(model))")
        own_settings = settings(debug_options)
        torch.nn.Module.__init__(self)  # not the model class's: the wrapper shares the model's tables
        for table in _SHARED_TABLES:
            object.__setattr__(self, table, getattr(module, table))
        object.__setattr__(self, "_original_module", module)
        self._settings = own_settings
        self._graphs = GraphCache(MAX_CACHED_GRAPHS)
        self._sessions = {}  # torch device -> the Sessions of its Placement
        self._state = ModuleState(module)
        self._density = DensityReport()  # ORTMODULE_PRINT_INPUT_DENSITY=1
        self._disk = ModuleGraphCache(own_settings.cache_directory)  # ORTMODULE_CACHE_DIR
        self.training = module.training

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
            return torch.nn.Module.__getattr__(self, name)  # not the model class's own __getattr__ (PeftModel's)
        except AttributeError:
            if "_original_module" not in self.__dict__:
                raise
            return _model_attribute(self, getattr(self._original_module, name))

    def __setattr__(self, name, value):
        if name in _SHARED_TABLES and "_original_module" in self.__dict__:
            if not same_entries(value, getattr(self, name)):
                kind = type(value)
                raise NotImplementedError(
                    f"ORTModule: its {name} table cannot be replaced by a {kind.__module__}.{kind.__qualname__} "
                    "holding other entries: it is the model's (one holding the same entries, as DeepSpeed ZeRO stage "
                    "3's, replaces the model's too)")
            object.__setattr__(self._original_module, name, value)  # DeepSpeed ZeRO-3's: both share it still
            object.__setattr__(self, name, value)
            return
        if name in _OWN or "_original_module" not in self.__dict__:
            torch.nn.Module.__setattr__(self, name, value)
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
        raise TypeError(DATA_PARALLEL_REFUSED)

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
            return torch.nn.Module.__reduce_ex__(self, protocol)
        return _new_wrapper, (model_class,), self.__getstate__()

    # ---------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        if called_by_data_parallel(self):
            raise TypeError(DATA_PARALLEL_REFUSED)
        model = self._original_module
        if (sharded := fsdp_state(model)) is not None:  # ORTModule(fully_shard(model))
            return call_between_hooks(model, sharded, lambda args, kwargs: self._forward(args, kwargs, None),
                                      args, kwargs)
        partitioned = _partitioned.partitioned(model.parameters())  # DeepSpeed ZeRO-3's
        if not partitioned:
            return self._forward(args, kwargs, None)
        with _partitioned.gathered(partitioned):
            return self._forward(args, kwargs, partitioned)

    def _forward(self, args, kwargs, partitioned):
        """forward() with the parameters whole; `partitioned`: those ZeRO-3 partitions (or None),
        gathered again for the backward."""
        model = self._original_module
        try:
            binding, values = bind_call(model, args, kwargs)
            named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            key = self._signature(binding, values, named)
        except BindingError as error:
            handle(error, self._settings, model)
            return model(*args, **kwargs)
        graph = self._graphs.get(key)
        if graph is None:
            with _partitioned.deepspeed_hooks_suspended(model) if partitioned else contextlib.nullcontext():
                graph = self._compile(binding, values, named, needs_grad=key.needs_grad)
            key = self._signature(binding, values, named)  # without attributes the probe saw forward() write
            self._graphs.put(key, graph)
        if graph is _PYTORCH:
            return model(*args, **kwargs)
        if self._settings.input_density:
            self._density.record(graph, values)
        feeds = graph.feeds(values, named)
        gather = functools.partial(_partitioned.gathered_until_backward_ends, partitioned) if partitioned else None
        outputs = _GraphFunction.apply(graph, gather, *feeds) if graph.trains else graph.infer(feeds)
        graph.batch_statistics.update(outputs)  # training-mode BatchNorms: their running statistics, as torch
        return graph.schema.rebuild(outputs)

    def _signature(self, binding, values, named) -> ModuleSignature:
        """What one compiled graph serves."""
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*values.values(), *named.values()))
        inputs = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in values.items())
        constants = tuple((name, type(value), value) for name, value in binding.constant_keywords.items())
        structures = tuple((name, structure.key) for name, structure in binding.structures.items())
        model = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in named.items())
        key = ModuleSignature(inputs, binding.positional, constants, structures, model, self._state.read(), _autocast(),
                              needs_grad)
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
        policy allows it (`_fallback`). The model's own errors (its forward fails in PyTorch)
        propagate, and so do errors that are no refusal (bugs)."""
        model = self._original_module
        disk_key, graph = self._from_disk(binding, values, named, needs_grad)
        if graph is not None:  # a graph on disk (ORTMODULE_CACHE_DIR): no probe, no compile
            return graph
        before = self._state.read()
        output, changed = probe_call(model, binding, values, grad=needs_grad)
        self._state.forgets(before, self._state.read())
        try:  # each refusal says its fallback category (`_fallback`)
            tensors = []
            schema = OutputSchema(output, tensors)
            functions = custom_functions(tensors, values.values())
            del output, tensors  # and the autograd graph of the probe
            if (synchronized := sync_batch_norm_refused(model, "it runs in PyTorch under the default fallback policy")):
                raise synchronized
            changed = untracked_changes(model, changed)  # BatchNorm running statistics: updated after each call
            if changed:
                raise TorchModelRefused(f"the model changes buffers {changed} in its forward, which an ONNX Runtime "
                                        "graph cannot write back (BatchNorm running statistics excepted)")
            if functions and not self._settings.custom_functions:
                raise custom_functions_refused(functions, "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1: they run in "
                                               "PyTorch under the default fallback policy")
            if (layerdrop := layerdrop_refused(model)) is not None:
                raise layerdrop
            sessions = self._sessions_of(values, named)
            compute_dtype = _compute_dtype(sessions.placement.ort_device)
            graph = ModuleGraph.compiled(model, binding, values, schema, sessions, self._settings, needs_grad,
                                         compute_dtype=compute_dtype)
            self._disk.store(disk_key, graph, model, self._state)
            return graph
        except REFUSED as error:  # another error is a bug: it propagates
            handle(error, self._settings, model)
            return _PYTORCH

    def _from_disk(self, binding, values, named, needs_grad):
        """(the key of this signature's graph in the cache on disk, the graph found there or None);
        (None, None) without a cache or on a device ONNX Runtime lacks (the compile says why)."""
        if self._settings.cache_directory is None or not {
                t.device.type for t in (*named.values(), *values.values())} <= {"cpu", "cuda"}:
            return None, None
        sessions = self._sessions_of(values, named)
        key = self._disk.key(self._original_module, self._state, binding, values, self._settings, sessions,
                             needs_grad=needs_grad, autocast=_autocast())
        return key, self._disk.load(key, self._original_module, self._state, sessions, self._settings)

    def _sessions_of(self, values, named):
        """The Sessions of the device the model and inputs are on (one per device)."""
        device = next((t.device for t in (*named.values(), *values.values())), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise DeviceRefused(f"ONNX Runtime does not run on torch device {device}")
        if device not in self._sessions:
            runtime = RuntimeSettings(device=str(device), threads=torch.get_num_threads(),
                                      log_severity=int(self._settings.ort_severity))
            self._sessions[device] = Sessions(Placement(str(device)), runtime)
        return self._sessions[device]


_WRAPPERS = (ORTModule, torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)  # refused as the model
_CLASSES: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()  # model class -> its ORTModule class


def _class_for(model_class):
    """ORTModule's subclass for models of `model_class`, named ORTModule, that also derives from
    `model_class`: `isinstance(ORTModule(model), type(model))` holds, for libraries that check a
    model's class (peft, diffusers, FSDP's class swap). Its `forward` has the model's signature: tools
    that inspect the class (transformers.Trainer's `find_labels` and `can_return_loss` read
    `type(model).forward`) see the model's parameters, not `(*args, **kwargs)`. What the model's
    classes define is looked up as before: a name ORTModule (or nn.Module) defines is ORTModule's,
    another is the model's (`_ModelAttribute`)."""
    cls = _CLASSES.get(model_class)
    if cls is None:
        @functools.wraps(model_class.forward)
        def forward(self, *args, **kwargs):
            return ORTModule.forward(self, *args, **kwargs)

        namespace = {"forward": forward, "__module__": ORTModule.__module__, "__qualname__": ORTModule.__qualname__,
                     "__doc__": ORTModule.__doc__}
        for name in _names_defined_by(model_class):
            if name in namespace or name in _TYPE_MACHINERY:
                continue
            ours = next((vars(klass)[name] for klass in ORTModule.__mro__[:-1] if name in vars(klass)), _MISSING)
            if ours is not _MISSING:
                namespace[name] = ours
            elif not (name.startswith("__") and name.endswith("__")):  # operators (len(), [...]) stay the class's
                namespace[name] = _ModelAttribute(model_class, name)
        cls = types.new_class(ORTModule.__name__, (ORTModule, model_class), exec_body=lambda ns: ns.update(namespace))
        _CLASSES[model_class] = cls
    return cls


_MISSING = object()
_TYPE_MACHINERY = frozenset(("__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__slots__",
                             "__annotations__", "__orig_bases__", "__parameters__", "__abstractmethods__", "_abc_impl",
                             "__init_subclass__", "__class_getitem__", "__firstlineno__", "__static_attributes__"))


def _names_defined_by(model_class):
    """The names the model's own classes (those nn.Module does not derive from) define."""
    own = [klass for klass in model_class.__mro__ if klass not in torch.nn.Module.__mro__]
    return list(dict.fromkeys(name for klass in own for name in vars(klass)))


class _ModelAttribute:
    """A name the model's class defines, read on the wrapper: the model's value (its own methods bound
    to the wrapper, as `ORTModule.__getattr__` gives them); on the class, the model class's."""

    def __init__(self, model_class, name):
        self._model_class, self._name = model_class, name

    def __get__(self, instance, owner=None):
        if instance is None:
            return getattr(self._model_class, self._name)
        return _model_attribute(instance, getattr(instance._original_module, self._name))


def _new_wrapper(model_class):
    """Unpickling: an empty ORTModule of `model_class`'s wrapper class (__setstate__ fills it)."""
    return torch.nn.Module.__new__(_class_for(model_class))


def _model_attribute(wrapper, value):
    """The model's attribute `value` as the wrapper gives it: a method of the model's own classes
    bound to the wrapper (its self(...) calls run the graph), anything else as it is."""
    if _is_model_method(value, wrapper._original_module):
        return types.MethodType(value.__func__, wrapper)
    return value


def _is_model_method(value, model):
    """Whether `value` is a method the model's own classes define, such as a train_step- or
    generate-style helper: bound to the wrapper instead, its `self(...)` calls run the graph, as
    in the original ORTModule. Methods of the libraries' base classes (nn.Module's, Hugging Face's
    and peft's `save_pretrained` or `generate`) stay the model's: they act on the model itself (its class
    name in a saved config, its PyTorch forward for generation with a cache). So does a method
    that calls zero-argument `super()`: it needs the model as `self`."""
    if not isinstance(value, types.MethodType) or value.__self__ is not model:
        return False
    function, code = value.__func__, getattr(value.__func__, "__code__", None)
    return (not getattr(function, "__module__", "").startswith(_LIBRARIES)
            and (code is None or "__class__" not in code.co_freevars))


def _compute_dtype(device_type):
    """The mixed-precision compute type of a call on `device_type` under torch.autocast
    ('float16', 'bfloat16'), or None outside autocast. Raises DeviceRefused (a NotImplementedError) where the
    device cannot compute in it (the call then runs in PyTorch under the default fallback policy);
    warns where it is slower than fp32."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    reason = unsupported(device_type, dtype)
    if reason is not None:
        raise DeviceRefused(f"torch.autocast({device_type!r}, {dtype}): {reason}")
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
