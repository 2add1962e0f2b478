"""ORTTrainerOptions: the legacy options tree, validated by ``schemas/options.yaml``."""
import enum
import pprint

from .validation import load_schema, validate

_CASTS = "ONNX Runtime's cast propagation; mixed precision places its casts by torch.autocast's op lists"
# Options that validate but are not implemented yet: path -> feature. Any value other than the
# default raises NotImplementedError. Remove an entry when its feature lands.
_NOT_YET_SUPPORTED = {
    "distributed.data_parallel_size": "data parallelism",
    "distributed.horizontal_parallel_size": "Megatron horizontal parallelism",
    "distributed.pipeline_parallel.pipeline_parallel_size": "pipeline parallelism",
    "distributed.pipeline_parallel.num_pipeline_micro_batches": "pipeline parallelism",
    "distributed.pipeline_parallel.pipeline_cut_info_string": "pipeline parallelism",
    "distributed.pipeline_parallel.sliced_schema": "pipeline parallelism",
    "distributed.pipeline_parallel.sliced_axes": "pipeline parallelism",
    "distributed.pipeline_parallel.sliced_tensor_names": "pipeline parallelism",
    "distributed.enable_adasum": "Adasum",
    "graph_transformer.allow_layer_norm_mod_precision": "LayerNorm in reduced precision; mixed precision keeps it fp32",
    "graph_transformer.propagate_cast_ops_config.strategy": _CASTS,
    "graph_transformer.propagate_cast_ops_config.level": _CASTS,
    "graph_transformer.propagate_cast_ops_config.allow": _CASTS,
    "utils.invertible_layer_norm_gradient": "invertible LayerNorm gradient",
    "utils.memory_efficient_gradient": "memory-efficient gradient",
    "_internal_use.enable_internal_postprocess": "disabling the internal postprocess",
    "_internal_use.extra_postprocess": "extra postprocess",
}

_PREFIX = "Invalid options"


RECOMPUTE_OPTIONS = ("gelu_recompute", "attn_dropout_recompute", "transformer_layer_recompute")


def recomputes(graph_transformer):
    """Whether a recompute option of `options.graph_transformer` is on."""
    return any(getattr(graph_transformer, name) for name in RECOMPUTE_OPTIONS)


class PropagateCastOpsStrategy(enum.IntEnum):
    """``graph_transformer.propagate_cast_ops_config.strategy`` as the original spelled it (ONNX
    Runtime's enum, same values); the option also takes a member's name, and ORT's own enum."""

    NONE = 0
    INSERT_AND_REDUCE = 1
    FLOOD_FILL = 2


def _lookup(options: dict, path: str):
    for key in path.split("."):
        options = options[key]
    return options


class _OptionGroup:
    """Read-only attribute view of one validated options group; nested groups become nested views."""

    def __init__(self, path: str, values: dict, schema: dict):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_values", values)
        for key, value in values.items():
            # Groups have a sub-schema; free-form maps (provider_options, sliced_axes, ...) stay dicts.
            sub_schema = schema[key].get("schema")
            if isinstance(sub_schema, dict) and isinstance(value, dict):
                value = _OptionGroup(f"{path}.{key}".lstrip("."), value, sub_schema)
            object.__setattr__(self, key, value)

    def __setattr__(self, key, value):
        path = f"{self._path}.{key}".lstrip(".")
        raise AttributeError(f"options are read-only (tried to set {path}); create new ORTTrainerOptions")

    def __repr__(self):
        return f"OptionGroup({self._path!r}, {pprint.pformat(self._values, sort_dicts=False)})"


class ORTTrainerOptions(_OptionGroup):
    """Training options, the original ``ORTTrainerOptions`` tree (schema: ``schemas/options.yaml``).

    Omitted keys get their defaults; nested groups read as attributes
    (``opts.utils.grad_norm_clip``, ``opts.distributed.deepspeed_zero_optimization.stage``) and the
    full normalized dict is ``opts._validated_opts``. Differences from the original:

    - ``device.id`` defaults to ``'cpu'`` (the original defaulted to ``'cuda'``); it must be
      ``'cpu'``, ``'cuda'`` or ``'cuda:N'``.
    - ``_internal_use.onnx_opset_version`` defaults to 14 and allows 14..17 (original: 12, 12..13).
    - Keys of later original versions: ``utils.memory_efficient_gradient`` (False, refused when set),
      ``graph_transformer.allow_layer_norm_mod_precision``, ``graph_transformer.propagate_cast_ops_config``.
    - Ours: ``utils.max_cached_graphs`` (8: bound on the per-input-shape graph cache),
      ``debug.graph_save_paths.eval_model_path`` ('': the eval graph) and
      ``graph_transformer.label_sparsity`` (True: a cross-entropy with an ignore_index computes the
      vocabulary projection and the loss on the kept labels' rows; with the fp32 logits fetched, they stay
      dense and the loss and the projection's gradients run on those rows) and
      ``graph_transformer.embedding_sparsity`` (True: the per-token layers after an embedding with a
      padding_idx compute the non-padding rows and one shared padded row, exactly).
    - ``provider_options`` names only the providers the trainer runs on (``CPUExecutionProvider``,
      which takes no options, and ``CUDAExecutionProvider`` on ``'cuda'``), and its options are
      merged into the trainer's; the original prepended unknown providers.
    - An explicit ``None`` is an error unless the field is nullable (the original filled the default).
    - ``graph_transformer.propagate_cast_ops_config.strategy`` reads back as the member's name
      (``'INSERT_AND_REDUCE'``), given as a ``PropagateCastOpsStrategy`` or as that name.
    - ``graph_transformer.number_recompute_layers`` needs ``transformer_layer_recompute`` (the
      original ignored it alone); more layers than the model has but one are clipped, with a warning.
    - ``_internal_use.enable_onnx_contrib_ops``: the exporter never emits ONNX Runtime contrib ops
      here (the original's False), whatever the value.
    - Options whose features are not implemented yet raise ``NotImplementedError`` when set to a
      non-default value (see ``_NOT_YET_SUPPORTED``).

    Args:
        options: nested dict of options, or None for all defaults.

    Raises:
        TypeError: ``options`` is not a dict.
        ValueError: ``"Invalid options: <path>: <constraint>, got <value>; ..."`` for every bad field.
        NotImplementedError: an option that is not supported yet has a non-default value.
    """

    def __init__(self, options: dict | None = None):
        validated = validate("options", {} if options is None else options, _PREFIX)
        defaults = validate("options", {}, _PREFIX)
        unsupported = [
            f"{path}={_lookup(validated, path)!r} ({feature})"
            for path, feature in sorted(_NOT_YET_SUPPORTED.items())
            if _lookup(validated, path) != _lookup(defaults, path)
        ]
        if unsupported:
            raise NotImplementedError(f"Option(s) not supported yet: {', '.join(unsupported)}")
        super().__init__("", validated, load_schema("options"))
        object.__setattr__(self, "_validated_opts", validated)

    def __repr__(self):
        return f"ORTTrainerOptions({pprint.pformat(self._validated_opts, sort_dicts=False)})"
