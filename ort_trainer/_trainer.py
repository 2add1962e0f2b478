"""ORTTrainer: orchestration of export, compiled graphs, flat buffers and the optimizer."""
import math
import warnings

import numpy as np
import onnx
import torch

from . import _checkpoint, _distributed, _export, _legacy_checkpoint, _onnx_model
from ._batch_norm import BatchStatistics, running_statistics, sync_batch_norm_refused
from ._binding import bind_inputs
from ._flat import FlatParameters, graph_name
from ._graph import LOSS_SCALE_INPUT, build_graphs, used_parameters
from ._guards import ModuleState
from ._inputs import InputChecks
from ._model_desc import parse_model_desc
from ._optimizers import state_names
from ._options import ORTTrainerOptions
from ._recompute import Recompute
from ._session import CompiledGraph, GraphCache, Placement
from ._session_config import save_graphs
from ._train_step_info import TrainStepInfo
from .amp import DynamicLossScaler
from .optim._config import _OptimizerConfig


class ORTTrainer:
    """Trains a torch model as one ONNX Runtime training graph (forward + loss + backward).

    Args:
        model: the `torch.nn.Module` to train. Its trainable parameters become views of the
            trainer's flat buffer, so `model.state_dict()` always holds the trained weights.
        model_desc: `{'inputs': [(name, shape[, dtype])], 'outputs': [(name, shape[, is_loss])]}`;
            string dims are dynamic, exactly one output is the loss (first when `loss_fn` is given).
        optim_config: `optim.SGDConfig`, `optim.AdamConfig` or `optim.LambConfig`.
        loss_fn: `loss_fn(model_output, *labels)`, traced into the same graph. Inputs reach
            `model.forward` by name (keywords); the inputs it does not take are the labels (the
            whole rule: `_binding.py`, README). `None`: the model's own output flagged
            `is_loss` is the loss.
        options: `ORTTrainerOptions` or a dict for it. Note `utils.grad_norm_clip` defaults to
            True (as in the original): gradients are clipped to `optim_config.max_norm_clip`
            (default 1.0) by global norm unless you turn it off.

    The graphs are exported and compiled lazily, on the first step, from that batch; one graph
    is kept per distinct input shape (a bounded cache), all sharing the same weights.
    """

    def __init__(self, model, model_desc, optim_config, loss_fn=None, options=None):
        if not isinstance(model, (torch.nn.Module, onnx.ModelProto)):
            raise TypeError(f"model must be a torch.nn.Module or an onnx.ModelProto, got {type(model).__name__}")
        if not isinstance(optim_config, _OptimizerConfig):
            raise TypeError("optim_config must be an optim.SGDConfig, optim.AdamConfig or optim.LambConfig, "
                            f"got {type(optim_config).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if options is None or isinstance(options, dict):
            options = ORTTrainerOptions(options)
        elif not isinstance(options, ORTTrainerOptions):
            raise TypeError(f"options must be an ORTTrainerOptions or a dict, got {type(options).__name__}")
        desc = parse_model_desc(model_desc)
        self._onnx_model = model if isinstance(model, onnx.ModelProto) else None
        if self._onnx_model is not None:
            desc = _onnx_model.describe(desc, model, loss_fn)
            if options.debug.check_model_export:
                raise ValueError("Invalid options: debug.check_model_export=True compares the graph with the torch "
                                 "model, and an ONNX model has none; leave it False")
            model = _onnx_model.OnnxModule(model)
        if loss_fn is not None and desc.loss_index != 0:
            raise ValueError("Invalid model_desc: with a loss_fn the loss must be the first output, "
                             f"got is_loss on output {desc.loss_index} ({desc.output_names[desc.loss_index]!r})")

        self.model = model
        self.model_desc = desc
        self.optim_config = optim_config
        self.loss_fn = loss_fn
        self.options = options
        if self._onnx_model is None:
            self._binding = bind_inputs(model, desc.input_names, loss_fn is not None)
        else:
            self._binding = _onnx_model.binding(desc)
        named = dict(model.named_parameters())
        frozen = list(options.utils.frozen_weights)
        unknown = sorted(set(frozen) - set(named))
        if unknown:
            raise ValueError(f"Invalid options: utils.frozen_weights names unknown parameters {unknown}; "
                             f"the model's parameters are {_first(named)}")
        self._frozen_names = set(frozen) | {name for name, p in named.items() if not p.requires_grad}
        self._requires_grad = [(name, p, p.requires_grad) for name, p in named.items()]
        not_float32 = {name: p.dtype for name, p in named.items()
                       if name not in self._frozen_names and p.dtype != torch.float32}
        if not_float32:
            raise TypeError(f"ORTTrainer trains float32 parameters (one flat fp32 buffer); got {not_float32}: "
                            "call model.float(), or freeze them (utils.frozen_weights)")
        # Validates param groups now (unknown names fail here, before any work).
        optim_config.resolve_groups([name for name in named if name not in self._frozen_names], self._frozen_names)

        self._recompute = Recompute.from_options(options.graph_transformer, model)
        self._distributed = _distributed.setup(options)
        self._placement = Placement(options, torch.get_num_threads())
        self._inputs = InputChecks(desc, self._binding, self._placement.torch_device)
        self._lr_scheduler = options.lr_scheduler
        with self._placement.allocating():
            self._loss_scaler, self._loss_scale = _loss_scaling(options, self._placement.xp)
        self._graphs = GraphCache(options.utils.max_cached_graphs)
        self._state = ModuleState(model)
        if self._onnx_model is None:
            self._exports = _export.TrainingExports(model, loss_fn, self._binding, desc.inputs, desc.output_names,
                                                    options._internal_use.onnx_opset_version)
        else:
            self._exports = _onnx_model.OnnxExports(self._onnx_model, model)
        self._sample_inputs = None
        self._flat = None
        self._frozen = {}  # graph name -> frozen weight the graphs read (bound as it is)
        self._optimizer = None
        self._scratch = None
        self._pending_optimizer_state = None
        self._train_step_info = TrainStepInfo(optim_config)

    # ---------------------------------------------------------------- steps
    def train_step(self, *args, **kwargs):
        """Forward, loss, backward, (clip) and one optimizer update. Returns the outputs of
        model_desc in order (one output bare, several as a list)."""
        inputs, signature = self._inputs.check("train_step", args, kwargs)
        if not self.model.training:
            warnings.warn(f"train_step: the model is in eval mode ({type(self.model).__name__}.training is False), "
                          "so it trains as torch would in eval mode: dropout off, norm layers on running "
                          "statistics. Call model.train() to train with dropout (from_pretrained() returns "
                          "models in eval mode)")
        with self._placement.step():
            graph = self._graph_for(signature, inputs, self._fetched_outputs("train_step"), training=True)
            self._distributed.broadcast_buffers(graph.batch_statistics.buffers())  # as DDP, before the forward
            accumulation = self.options.batch.gradient_accumulation_steps
            micro_step = self._train_step_info.step % accumulation
            if micro_step == 0:
                outputs = graph.run(True, inputs, self._flat.grads)
                self._distributed.reduce_gradients(self._flat.grads, accumulated=False)
            else:
                outputs = graph.run(True, inputs, self._accumulation_scratch())
                self._distributed.reduce_gradients(self._scratch, accumulated=False)
                self._flat.grads += self._scratch
            self._train_step_info.step += 1
            if micro_step == accumulation - 1:
                self._distributed.reduce_gradients(self._flat.grads, accumulated=True)
                self._update()
        outputs = self._placement.returned(outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def _accumulation_scratch(self):
        """Where micro-steps after the first write their gradients before adding them up."""
        if self._scratch is None:
            with self._placement.allocating():
                self._scratch = self._flat.grads.copy()
        return self._scratch

    def _update(self):
        """One optimizer update from the (accumulated) gradients: unscaled, clipped by global
        norm, and skipped (weights and optimizer state untouched) when under loss scaling a
        gradient is not finite."""
        info = self._train_step_info
        lr = self._lr_scheduler._step(info)[0] if self._lr_scheduler is not None else self.optim_config.lr
        clip = self.options.utils.grad_norm_clip
        divisor, info.all_finite = 1.0, True
        if clip or self._loss_scaler is not None:
            loss_scale = self._loss_scaler.loss_scale if self._loss_scaler is not None else 1.0
            max_norm = self.optim_config.max_norm_clip if clip else math.inf
            divisor, norm = self._distributed.clip_divisor(self._flat.grads, max_norm, loss_scale)
            info.all_finite = self._loss_scaler is None or math.isfinite(norm)  # a host sync, only then
        if info.all_finite:
            self._optimizer.step(self._flat.params, self._flat.grads, lr, divisor)
            info.optimization_step += 1
        if self._loss_scaler is not None:
            self._loss_scale[...] = self._loss_scaler.update(info)

    @property
    def train_step_info(self):
        """Step counters: `step` (train_step calls), `optimization_step` (updates applied) and
        `all_finite` (False when the last update was skipped for non-finite gradients)."""
        return self._train_step_info

    def eval_step(self, *args, **kwargs):
        """Forward and loss with dropout off; no gradient, no update, no step counted."""
        inputs, signature = self._inputs.check("eval_step", args, kwargs)
        with self._placement.step():
            graph = self._graph_for(signature, inputs, self._fetched_outputs("eval_step"), training=False)
            outputs = graph.run(False, inputs)
        outputs = self._placement.returned(outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self, pytorch_format=False):
        """Everything a resume needs, as tensors and plain values under the torch model's names
        (`pytorch_format=True`, the original's flag: the model's weights alone, as
        `model.state_dict()`).

        `state_dict()['model']` loads into the plain torch model. Optimizer state is stored per
        parameter (`optimizer.state[<name>][<param>]`), so it does not depend on the flat layout.
        `trainer_options` records the options (plain values) for reference; loading does not
        apply them.
        Under ZeRO stage 1 the full state is gathered from every rank: every rank must call it.
        """
        model = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        if pytorch_format:
            return model
        with self._placement.step():  # the optimizer state as the last update left it
            optimizer = self._optimizer_state_dict()
        return {"model": model, "optimizer": optimizer, **self._counters_and_components()}

    def _counters_and_components(self):
        """The state_dict sections besides the weights and the optimizer state."""
        info = self._train_step_info
        return {
            "train_step_info": {"step": info.step, "optimization_step": info.optimization_step},
            "lr_scheduler": None if self._lr_scheduler is None else self._lr_scheduler.state_dict(),
            "loss_scaler": None if self._loss_scaler is None else self._loss_scaler.state_dict(),
            "trainer_options": _checkpoint.plain(self.options._validated_opts),
        }

    def load_state_dict(self, state_dict, strict=True):
        """Restores a `state_dict()`. Everything is checked before anything changes: another
        model's checkpoint is refused with the mismatched keys named. `strict=False` allows
        missing or unexpected model keys (shapes must still match). A state_dict of the original
        ORTTrainer (`model.full_precision`, Moment_1/Moment_2/Update_Count) is read too."""
        if _legacy_checkpoint.is_original_layout(state_dict):
            state_dict = _legacy_checkpoint.to_our_layout(
                state_dict, optimizer_name=self.optim_config.name, state_names=state_names(self.optim_config.name),
                current=self._counters_and_components())
        _checkpoint.check_trainer_state(
            state_dict, model=self.model, optimizer_name=self.optim_config.name,
            optimizer_state_names=state_names(self.optim_config.name), trained=self._trained_parameters(),
            components={"lr_scheduler": self._lr_scheduler, "loss_scaler": self._loss_scaler}, strict=strict,
            optimizer_built=self._optimizer is not None,
            accumulation_steps=self.options.batch.gradient_accumulation_steps)
        optimizer = state_dict["optimizer"]
        self.model.load_state_dict(state_dict["model"], strict=strict)
        with self._placement.step():
            if self._optimizer is None:
                self._pending_optimizer_state = optimizer
            else:
                _checkpoint.load_optimizer_state(self._flat, self._optimizer, optimizer)
            if self._loss_scaler is not None:
                self._loss_scaler.load_state_dict(state_dict["loss_scaler"])
                self._loss_scale[...] = self._loss_scaler.loss_scale
        info = state_dict["train_step_info"]
        self._train_step_info.step = info["step"]
        self._train_step_info.optimization_step = info["optimization_step"]
        if self._lr_scheduler is not None:
            self._lr_scheduler.load_state_dict(state_dict["lr_scheduler"])

    def save_checkpoint(self, path, user_dict=None):
        """Writes `state_dict()` (plus `user_dict`) to `path` atomically (torch.save format).

        Distributed, every rank must call it: rank 0 writes `path`, with the full optimizer state
        (under ZeRO stage 1 gathered from every rank, so it loads on any world size). It returns
        when the file is written, or raises on every rank if writing it failed."""
        micro_step = self._train_step_info.step % self.options.batch.gradient_accumulation_steps
        if micro_step:
            raise RuntimeError(
                f"save_checkpoint() in the middle of a gradient-accumulation cycle (micro-step {micro_step} of "
                f"{self.options.batch.gradient_accumulation_steps}) would lose the accumulated gradients; "
                "save right after an update")
        self._distributed.save_checkpoint(path, {**self.state_dict(), "user_dict": user_dict or {}})

    def load_checkpoint(self, path, strict=True):
        """Loads a `save_checkpoint()` file; returns its `user_dict`. Distributed, every rank loads
        the same `path` (under ZeRO, each keeps its shard of the optimizer state, whatever the
        world size that saved it)."""
        state = _checkpoint.load(path)
        user_dict = state.pop("user_dict", {})
        self.load_state_dict(state, strict=strict)
        return user_dict

    def _optimizer_state_dict(self):
        """The optimizer section: its per-parameter state, or (before the first step) the state
        a load_state_dict left pending."""
        if self._optimizer is None:
            pending = self._pending_optimizer_state or {"step_count": 0, "state": {}}
            return {"name": self.optim_config.name, "step_count": pending["step_count"], "state": pending["state"]}
        return {"name": self.optim_config.name, "step_count": self._optimizer.step_count,
                "state": _checkpoint.optimizer_state(self._flat, self._optimizer)}

    def _trained_parameters(self):
        """{torch name: parameter} of what the optimizer updates (before the first compile: every
        parameter that is not frozen)."""
        named = dict(self.model.named_parameters())
        if self._flat is not None:
            return {name: named[name] for name in self._flat.torch_names}
        return {name: p for name, p in named.items() if name not in self._frozen_names}

    # ---------------------------------------------------------------- export
    def export_onnx(self, path):
        """Writes the trained model as an inference ONNX model (forward only, dropout off).

        Weights are initializers; the model's inputs (labels excluded) keep the dynamic axes of
        model_desc where the exported graph verifiably handles other sizes. Dims the exporter
        baked in are made static, with a warning that names them. The file is written atomically.
        Needs one train_step or eval_step first (its batch is the export sample).
        """
        if self._onnx_model is not None:
            raise TypeError("export_onnx() writes the torch model's inference graph; this trainer trains an ONNX "
                            "model, whose graph computes the loss: save_as_onnx() writes it with the trained weights")
        if self._sample_inputs is None:
            raise RuntimeError("export_onnx() needs a sample batch: call train_step() or eval_step() once first")
        model_inputs = self._binding.model_inputs
        outputs = self.model_desc.output_names[1:] if self.loss_fn is not None else self.model_desc.output_names
        with self._placement.step():  # the weights as the last update left them
            serialized, static = _export.export_inference_model(
                self.model, self._binding, [spec for spec in self.model_desc.inputs if spec.name in model_inputs],
                outputs, {name: self._sample_inputs[name] for name in model_inputs},
                self.options._internal_use.onnx_opset_version)
        if static:
            warnings.warn(f"export_onnx: dims {static} are fixed to the sample batch's sizes: the exporter baked "
                          "them into the graph (e.g. nn.MultiheadAttention's sequence length)")
        _checkpoint.atomic_write(path, lambda file: file.write(serialized))

    def save_as_onnx(self, path):
        """Writes the forward + loss model (the original ORTTrainer's `save_as_onnx`): the graph the
        training graph is built from, with the trained weights as initializers named as in
        `state_dict()['model']`. The file is written atomically. A torch model needs one
        train_step or eval_step first (its batch is the export sample); `export_onnx` writes the
        model alone, for inference."""
        if self._sample_inputs is None and self._onnx_model is None:
            raise RuntimeError("save_as_onnx() needs a sample batch: call train_step() or eval_step() once first")
        with self._placement.step():  # the weights as the last update left them
            model = self._exports.with_weights(self._sample_inputs)
        _checkpoint.atomic_write(path, lambda file: file.write(model.SerializeToString()))

    # ---------------------------------------------------------------- inputs
    def _fetched_outputs(self, method):
        """The outputs to compute and return: `train_step_info.fetches`, or all of model_desc's.

        Not fetching a big output (the logits) saves its memory and the time to write it.
        """
        fetches = tuple(self._train_step_info.fetches)
        unknown = [name for name in fetches if name not in self.model_desc.output_names]
        if unknown:
            raise ValueError(f"{method}(): train_step_info.fetches names unknown outputs {unknown}; "
                             f"model_desc outputs are {list(self.model_desc.output_names)}")
        return fetches or self.model_desc.output_names

    # ---------------------------------------------------------------- graphs
    def _graph_for(self, signature, values, outputs, training):
        """The cached graph for this input signature and these outputs, else a new one.

        A graph serves the model state it was traced in (`_guards.ModuleState`): the modules'
        plain attributes and hooks, and for training the train/eval flags (they are the user's: a
        submodule in eval mode trains with its dropout off, as in torch; eval graphs turn dropout
        off either way). A step after that state changed compiles again."""
        changed = [name for name, parameter, requires_grad in self._requires_grad
                   if parameter.requires_grad != requires_grad]
        if changed:
            raise ValueError(f"requires_grad of parameters {_first(changed)} changed since the trainer was created: "
                             "the parameters it trains are fixed then (those that require grad, less "
                             "utils.frozen_weights). Create a new ORTTrainer to train another set")
        flags, attributes = self._state.read()
        graph = self._graphs.get((signature, outputs))
        if graph is None or graph.model_state[1] != attributes or (training and graph.model_state[0] != flags):
            graph = self._compile_graph(values, outputs)
            self._graphs.put((signature, outputs), graph)
        return graph

    def _compile_graph(self, values, outputs):
        """Probe, export (or re-derive), create the flat buffers on the first compile, build.

        A graph re-derived from an earlier export (a new input shape) is first proven against
        torch at this shape; one that fails is traced again."""
        desc = self.model_desc
        refused = sync_batch_norm_refused(self.model, "convert them to BatchNorm: each rank then normalizes with "
                                                      "the statistics of its own batch, as DistributedDataParallel "
                                                      "with nn.BatchNorm*d does; or put them in eval mode")
        if refused is not None:
            raise refused
        before = self._state.read()
        self._exports.check(values, desc)
        self._state.forgets(before, self._state.read())
        state = self._state.read()
        exported, unproven = self._exports.get(values, state)
        if self._flat is None:
            self._create_training_state(used_parameters(exported))
        else:
            self._check_same_parameters(used_parameters(exported), values)
        if unproven:
            graph = self._proven_or_none(exported, values, outputs, state)
        else:
            graph = self._build(exported, values, outputs, state)
        if graph is None:
            self._exports.reject(values, state)
            graph = self._build(self._exports.get(values, state)[0], values, outputs, state)
        if self.options.debug.check_model_export:
            difference = self._differs_from_torch(graph, values, outputs)
            if difference is not None:
                raise RuntimeError(f"debug.check_model_export: {difference}")
        if self._sample_inputs is None:
            self._inputs.remember_dtypes(values)
            self._sample_inputs = values
        return graph

    def _check_same_parameters(self, graph_names, values):
        """Every graph reads the parameters the first one did: the flat buffers and the optimizer
        are laid out once, at the first compile, and each update is one pass over all of them."""
        named = dict(self.model.named_parameters())
        laid_out = set(self._flat.names) | set(self._frozen)
        new = [name for name in named if graph_name(name) in graph_names and graph_name(name) not in laid_out]
        self._bind_frozen(named, [name for name in new if name in self._frozen_names])  # read, never trained
        new = [name for name in new if name not in self._frozen_names]
        missing = [name for name in self._flat.torch_names if graph_name(name) not in graph_names]
        if not new and not missing:
            return
        absent = [name for name, value in values.items() if value is None]
        inputs = f"these inputs (None: {absent})" if absent else "these inputs (all given)"
        if new:
            problem = (f"with {inputs} the model uses parameters {new} that the first compiled call did not, so "
                       "they have no place in the trainer's flat buffers")
        else:
            problem = (f"with {inputs} the model leaves the trained parameters {missing} unused, and each update "
                       "would still move them (momentum, weight decay) where torch's optimizer skips them")
        raise ValueError(f"{problem}: the parameters a model uses must not depend on which optional inputs are "
                         "given (the flat buffers are laid out at the first step). Give the same inputs on every "
                         "call, or freeze the parameters that depend on them (utils.frozen_weights)")

    def _bind_frozen(self, named, names):
        """Adds frozen parameters to the weights every graph reads as they are (contiguous, no copy)."""
        for name in names:
            named[name].data = named[name].data.contiguous()
            self._frozen[graph_name(name)] = named[name].data

    def _build(self, exported, values, outputs, state):
        """Training and eval graphs from an export (consumed), on the flat buffers."""
        paths = self.options.debug.graph_save_paths
        save_graphs(paths, exported=exported)
        running, statistics = running_statistics(exported, self.model), BatchStatistics(self.model)
        training_graph, evaluation = build_graphs(
            exported, self._flat.names, list(self._frozen), outputs,
            self.model_desc.output_names[self.model_desc.loss_index], loss_scaling=self._loss_scaler is not None,
            substitute_kernels=self._placement.substitute_kernels, recompute=self._recompute,
            shape_inference=self.options.utils.run_symbolic_shape_infer, buffers=list(running),
            batch_statistics=statistics)
        save_graphs(paths, training=training_graph, evaluation=evaluation,
                    session_options=self._placement.session_options(), providers=self._placement.providers)
        present = [name for name, value in values.items() if value is not None]
        feeds = {LOSS_SCALE_INPUT: self._loss_scale} if self._loss_scaler else None
        return CompiledGraph(training_graph, evaluation, self._placement, self._flat, {**self._frozen, **running},
                             present, outputs, feeds=feeds, model_state=state, batch_statistics=statistics)

    def _proven_or_none(self, exported, values, outputs, state):
        """The graph re-derived for a new shape, if it builds and its eval graph matches torch's
        forward there; None otherwise (e.g. a size the first trace saw as 1 was specialized)."""
        try:
            graph = self._build(exported, values, outputs, state)
        except Exception:  # ORT rejects the graph at this shape: tracing it again decides
            return None
        return graph if self._differs_from_torch(graph, values, outputs) is None else None

    def _differs_from_torch(self, graph, values, outputs):
        """None when the eval graph computes what torch's eval-mode forward does on `values`."""
        return _export.eval_graph_differs(graph, self.model, self.loss_fn, self._binding, values,
                                          self.model_desc.output_names, outputs)

    def _create_training_state(self, graph_names):
        """The flat buffers and the optimizer, for the parameters the graph uses (unused ones stay
        untouched, as in torch), with any optimizer state loaded before the first step."""
        named = {name: p for name, p in self.model.named_parameters()}
        used = {name for name in named if graph_name(name) in graph_names}
        unused = sorted(set(named) - used - self._frozen_names)
        if unused:
            warnings.warn(f"parameters {unused} are not used by the model's forward/loss and will not be trained")
        trainable = [name for name in named if name in used and name not in self._frozen_names]
        if not trainable:
            raise ValueError("the model has no trainable parameter used by its forward/loss")
        groups = [(names, hyper) for names, hyper in
                  self.optim_config.resolve_groups(trainable, set(named) - set(trainable)) if names]
        with self._placement.allocating():
            self._flat = FlatParameters(named, groups, self._placement.xp)
            self._optimizer = self._distributed.make_optimizer(self.optim_config.name, self._flat)
        self._bind_frozen(named, sorted(self._frozen_names & used))
        if self._pending_optimizer_state is not None and self._pending_optimizer_state["state"]:
            _checkpoint.load_optimizer_state(self._flat, self._optimizer, self._pending_optimizer_state)
        self._pending_optimizer_state = None


def _loss_scaling(options, xp):
    """(scaler, scale feed) under mixed precision, else (None, None).

    The scale is a 0-d array (on the graphs' device) bound to the training graph once and
    updated in place.
    """
    mixed_precision = options.mixed_precision
    if not mixed_precision.enabled:
        if mixed_precision.loss_scaler is not None:
            raise ValueError("Invalid options: mixed_precision.loss_scaler is set, but mixed_precision.enabled "
                             "is False (loss scaling is part of mixed precision)")
        return None, None
    scaler = mixed_precision.loss_scaler or DynamicLossScaler()
    warnings.warn("mixed_precision.enabled: the graphs compute in fp32 (fp16 compute is not implemented yet); "
                  "dynamic loss scaling and skipping updates with non-finite gradients are active")
    return scaler, xp.array(scaler.loss_scale, dtype=np.float32)


def _first(names, count=10):
    names = list(names)
    return names[:count] + (["..."] if len(names) > count else [])
