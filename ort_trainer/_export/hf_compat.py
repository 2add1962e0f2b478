"""Lets the TorchScript exporter trace Hugging Face attention masks.

Why: transformers' `masking_utils` (4.53 on) builds the 4D attention mask by
running index-based mask functions (`causal_mask_function`, `padding_mask_function`, ...) under
`torch.vmap`, inside torch's `TransformGetItemToIndex` mode. That mode turns the padding lookup
`padding_mask[batch_idx, kv_idx]` into `ModIndex.apply(padding_mask, [batch_idx, kv_idx])`, an
autograd.Function that takes a *list* of tensors, and the TorchScript tracer cannot record such a
call: `RuntimeError: unordered_map::at`. So any model whose mask comes from `create_causal_mask`
(GPT-2, Llama, Mistral, ...; with attn_implementation "sdpa" and "eager" alike, since
`eager_mask` calls `sdpa_mask`) fails to export as soon as it gets an `attention_mask`.
Without one the mask functions index nothing and the vmap path traces fine.

`export_patches(model)` swaps, while the exporter runs, that vmap expansion for plain
broadcasting of the same mask functions over (batch, head, q, kv) index tensors: the approach
transformers 5 made its default (`masking_utils._non_vmap_expansion_sdpa`). The mask values are
the same (bit-identical, tests/test_hf_compat.py); the trace holds ordinary indexing and
comparison ops, with dynamic shapes. It touches only module attributes of
`transformers.masking_utils`, restored on exit:

- `_vmap_for_bhqkv` (transformers 4.x, checked on 4.57.1: every sdpa/eager mask);
- `_vmap_expansion_sdpa` (transformers 5, checked on 5.23.0: only masks with a model's own
  `or_mask_function`/`and_mask_function`, e.g. Gemma 3 image tokens; the default is already
  broadcast);
- `TransformGetItemToIndex`, made a no-op: with broadcast indices plain indexing is right.

Not fixed here (torch's sdpa symbolic, not the mask): with "sdpa", a query row that may attend
to no key (left padding in a causal LM) gets NaN gradients in ORT; the test marks it xfail.
"""
import contextlib
import sys
import warnings

_EXPANSIONS = ("_vmap_for_bhqkv", "_vmap_expansion_sdpa")


def _broadcast_expansion(mask_function, bh_indices=True):
    """Drop-in for transformers' vmap expansion: mask_function evaluated over the product of the
    (batch, head, q, kv) index ranges by broadcasting. `bh_indices=False` (torch < 2.6 path):
    batch and head come as None and the mask is (q, kv)."""

    def expanded(batch_idx, head_idx, q_idx, kv_idx):
        if not bh_indices:
            mask = mask_function(None, None, q_idx[:, None], kv_idx[None, :])
            return mask.expand(q_idx.shape[0], kv_idx.shape[0])
        mask = mask_function(batch_idx[:, None, None, None], head_idx[None, :, None, None],
                             q_idx[None, None, :, None], kv_idx[None, None, None, :])
        return mask.expand(batch_idx.shape[0], head_idx.shape[0], q_idx.shape[0], kv_idx.shape[0])

    return expanded


def _is_transformers_model(model):
    """Whether any submodule's class (or a base of it) comes from transformers."""
    return any(cls.__module__.startswith("transformers.")
               for module in model.modules() for cls in type(module).__mro__)


@contextlib.contextmanager
def export_patches(model):
    """Context for torch.onnx.export (TorchScript) of `model`: Hugging Face attention masks
    built without vmap, same values. A no-op (transformers not even imported) unless `model`
    contains a transformers module; everything is restored on exit, exceptions included."""
    masking_utils = sys.modules.get("transformers.masking_utils")
    if masking_utils is None or not _is_transformers_model(model):
        yield
        return
    # The exporter warns about every advanced indexing; transformers indexes with positions (never
    # negative), so the warning says nothing about these models (the caller's warnings context
    # scopes this filter to the export).
    warnings.filterwarnings("ignore", message="Exporting aten::index operator of advanced indexing")
    patches = {name: _broadcast_expansion for name in _EXPANSIONS if hasattr(masking_utils, name)}
    if hasattr(masking_utils, "TransformGetItemToIndex"):
        patches["TransformGetItemToIndex"] = contextlib.nullcontext
    originals = {name: getattr(masking_utils, name) for name in patches}
    try:
        for name, replacement in patches.items():
            setattr(masking_utils, name, replacement)
        yield
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)
