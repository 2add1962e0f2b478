"""ORTTrainer: orchestration of export, compiled graphs, flat buffers and the optimizer."""
import math
import warnings

import onnx
import torch

from .. import _checkpoint_files
from .._compile import inference as _inference
from .._compile.cache import GraphCache
from .._compile.exports import TrainingExports
from .._compile.trainer_compiler import StepCompiler, StepSettings
from .._configuration.model_desc import parse_model_desc
from .._configuration.options import ORTTrainerOptions
from .._configuration.runtime_settings import RuntimeSettings
from .._export import onnx_model as _onnx_model
from .._export.binding import bind_inputs
from .._export.guards import ModuleState
from .._graph.recompute import Recompute
from .._optimizers.algorithms import state_names
from .._runtime.placement import Placement
from .._runtime.sessions import Sessions
from ..optim._config import _OptimizerConfig
from . import checkpoint as _checkpoint
from . import distributed as _distributed
from . import legacy_checkpoint as _legacy_checkpoint
from .device_scaling import DeviceScaling, runs_on_device
from .inputs import InputChecks
from .mixed_precision import mixed_precision
from .train_step_info import TrainStepInfo
from .weights import TrainerWeights


class ORTTrainer:
    """Trains a torch model as one ONNX Runtime training graph (forward + loss + backward).

    Args:
        model: the `torch.nn.Module` to train, moved to `options.device.id` (`model.to`) if it
            is elsewhere (the original accepted a model on any device). Its trainable parameters
            become views of the trainer's flat buffer, so `model.state_dict()` always holds the
            trained weights.
        model_desc: `{'inputs': [(name, shape[, dtype])], 'outputs': [(name, shape[, is_loss])]}`;
            string dims are dynamic, exactly one output is the loss (first when `loss_fn` is given).
        optim_config: `optim.SGDConfig`, `optim.AdamConfig` or `optim.LambConfig`.
        loss_fn: `loss_fn(model_output, *labels)`, traced into the same graph. Inputs reach
            `model.forward` by name (keywords); the inputs it does not take are the labels (the
            whole rule: `_export/binding.py`, README). `None`: the model's own output flagged
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
        self._weights = TrainerWeights(model, list(options.utils.frozen_weights), optim_config)
        recompute = Recompute.from_options(options.graph_transformer, model)
        self._distributed = _distributed.setup(options)
        self._placement = Placement(options.device.id)
        self._sessions = Sessions(self._placement, RuntimeSettings.of_trainer(options, torch.get_num_threads()))
        self._inputs = InputChecks(desc, self._binding, self._placement.torch_device)
        self._lr_scheduler = options.lr_scheduler
        with self._placement.allocating():
            precision = mixed_precision(options.mixed_precision, self._placement.ort_device, self._placement.xp)
        self._loss_scaler, self._loss_scale = precision.scaler, precision.scale
        self._device_scaling = None  # CUDA: loss-scaled updates decided on the device, from the first update
        self._graphs = GraphCache(options.utils.max_cached_graphs)
        self._placement.take(model)  # after every check (a refused call changes nothing), before ModuleState
        self._state = ModuleState(model)
        if self._onnx_model is None:
            exports = TrainingExports(model, loss_fn, self._binding, desc.inputs, desc.output_names,
                                      options._internal_use.onnx_opset_version)
        else:
            exports = _onnx_model.OnnxExports(self._onnx_model, model)
        settings = StepSettings(recompute=recompute, shape_inference=options.utils.run_symbolic_shape_infer,
                                graph_save_paths=options.debug.graph_save_paths,
                                check_model_export=options.debug.check_model_export,
                                loss_scaling=self._loss_scaler is not None, compute_dtype=precision.compute_dtype,
                                label_sparsity=options.graph_transformer.label_sparsity,
                                embedding_sparsity=options.graph_transformer.embedding_sparsity,
                                opset=options._internal_use.onnx_opset_version,
                                frozen_weights=tuple(options.utils.frozen_weights),
                                cache_directory=(options.utils.graph_cache_dir or None) if self._onnx_model is None
                                else None)
        self._compiler = StepCompiler(model, loss_fn, self._binding, desc, exports=exports, state=self._state,
                                      sessions=self._sessions, settings=settings)
        self._sample_inputs = None  # the first compiled batch: the export sample of export_onnx/save_as_onnx
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
            flat = self._weights.flat
            grads = flat.grads if micro_step == 0 else self._weights.scratch(self._placement)
            with self._weights.gradients_from_the_graph_only(check=graph.runs_autograd_functions):
                outputs = graph.run(inputs, training=True, grads=grads)
            self._distributed.reduce_gradients(grads, accumulated=False)
            if micro_step != 0:
                flat.grads += grads
            self._train_step_info.step += 1
            if micro_step == accumulation - 1:
                self._distributed.reduce_gradients(flat.grads, accumulated=True)
                self._update()
        outputs = self._placement.returned(outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def _update(self):
        """One optimizer update from the (accumulated) gradients: unscaled, clipped by global
        norm, and skipped (weights and optimizer state untouched) when under loss scaling a
        gradient is not finite. On CUDA under DynamicLossScaler all of it is decided on the device
        (`device_scaling`), with no host sync."""
        info = self._train_step_info
        clip = self.options.utils.grad_norm_clip
        max_norm = self.optim_config.max_norm_clip if clip else math.inf
        if self._device_scaling is None and runs_on_device(self._placement.ort_device, self._loss_scaler):
            self._device_scaling = DeviceScaling(
                scaler=self._loss_scaler, graph_scale=self._loss_scale, info=info, scheduler=self._lr_scheduler,
                optimizer=self._weights.optimizer, optim_config=self.optim_config, placement=self._placement,
                size=self._weights.flat.grads.size)
        if self._device_scaling is not None:
            self._device_scaling.update(self._weights.flat, lr=self.optim_config.lr, max_norm=max_norm)
            return
        lr = self._lr_scheduler._step(info)[0] if self._lr_scheduler is not None else self.optim_config.lr
        divisor, info.all_finite = 1.0, True
        if clip or self._loss_scaler is not None:
            loss_scale = self._loss_scaler.loss_scale if self._loss_scaler is not None else 1.0
            divisor, norm = self._distributed.clip_divisor(self._weights.flat.grads, max_norm, loss_scale)
            info.all_finite = self._loss_scaler is None or math.isfinite(norm)  # a host sync, only then
        if info.all_finite:
            self._weights.optimizer.step(self._weights.flat.params, self._weights.flat.grads, lr, divisor)
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
            outputs = graph.run(inputs, training=False)
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
            optimizer = self._weights.optimizer_state_dict()
        return {"model": model, "optimizer": optimizer, **self._counters_and_components()}

    def _counters_and_components(self):
        """The state_dict sections besides the weights and the optimizer state."""
        info = self._train_step_info
        return {
            "train_step_info": {"step": info.step, "optimization_step": info.optimization_step},
            "lr_scheduler": None if self._lr_scheduler is None else self._lr_scheduler.state_dict(),
            "loss_scaler": None if self._loss_scaler is None else self._loss_scaler.state_dict(),
            "trainer_options": _checkpoint_files.plain(self.options._validated_opts),
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
        _checkpoint.TrainerState(
            model=self.model, optimizer_name=self.optim_config.name,
            optimizer_state_names=state_names(self.optim_config.name), trained=self._weights.trained(),
            optimizer_built=self._weights.optimizer is not None,
            components={"lr_scheduler": self._lr_scheduler, "loss_scaler": self._loss_scaler},
            accumulation_steps=self.options.batch.gradient_accumulation_steps).check(state_dict, strict=strict)
        self.model.load_state_dict(state_dict["model"], strict=strict)
        with self._placement.step():
            self._weights.load_optimizer_state(state_dict["optimizer"])
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
        if not outputs:
            raise ValueError(f"export_onnx() writes the model without its loss, whose outputs are model_desc's outputs "
                             f"after the loss; model_desc['outputs'] declares only the loss "
                             f"{self.model_desc.output_names[0]!r}: declare the model's outputs after it (e.g. "
                             "('output', ['batch', 10])) in a new trainer, or write the model with its loss by "
                             "save_as_onnx()")
        with self._placement.step():  # the weights as the last update left them
            serialized, static = _inference.export_inference_model(
                self.model, self._binding, [spec for spec in self.model_desc.inputs if spec.name in model_inputs],
                outputs, {name: self._sample_inputs[name] for name in model_inputs},
                self.options._internal_use.onnx_opset_version)
        if static:
            warnings.warn(f"export_onnx: dims {static} are fixed to the sample batch's sizes: the exporter baked "
                          "them into the graph (e.g. nn.MultiheadAttention's sequence length)")
        _checkpoint_files.atomic_write(path, lambda file: file.write(serialized))

    def save_as_onnx(self, path):
        """Writes the forward + loss model (the original ORTTrainer's `save_as_onnx`): the graph the
        training graph is built from, with the trained weights as initializers named as in
        `state_dict()['model']`. The file is written atomically. A torch model needs one
        train_step or eval_step first (its batch is the export sample); `export_onnx` writes the
        model alone, for inference."""
        if self._sample_inputs is None and self._onnx_model is None:
            raise RuntimeError("save_as_onnx() needs a sample batch: call train_step() or eval_step() once first")
        with self._placement.step():  # the weights as the last update left them
            model = self._compiler.with_weights(self._sample_inputs)
        _checkpoint_files.atomic_write(path, lambda file: file.write(model.SerializeToString()))

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

        A graph serves the model state it was traced in (`_export.guards.ModuleState`): the
        modules' plain attributes and hooks, and for training the train/eval flags (they are the
        user's: a submodule in eval mode trains with its dropout off, as in torch; eval graphs
        turn dropout off either way). A step after that state changed compiles again."""
        self._weights.check_requires_grad()
        state = self._state.read()
        graph = self._graphs.get((signature, outputs))
        if graph is None or graph.model_state.attributes != state.attributes or (
                training and graph.model_state.flags != state.flags):
            graph = self._compile(values, outputs)
            self._graphs.put((signature, outputs), graph)
        return graph

    def _compile(self, values, outputs):
        """Export (or re-derive), lay out the flat buffers and the optimizer on the first compile,
        build (`_compile.trainer_compiler`)."""
        export = self._compiler.export(values, outputs)
        if self._weights.flat is None:
            self._weights.lay_out(export.weight_names, self._placement, self._distributed)
        else:
            self._weights.check_same_parameters(export.weight_names, values)
        graph = self._compiler.build(export, values, outputs, flat=self._weights.flat,
                                     frozen=self._weights.read_only, loss_scale=self._loss_scale)
        if self._sample_inputs is None:
            self._inputs.remember_dtypes(values)
            self._sample_inputs = values
        return graph
