"""One TP rank's slices of a model, read from its files a layer at a time (``--tp``).

A rank of a TP group never holds the whole model, not even while it loads: mlx-lm's
model is built as a skeleton of empty placeholders (models/partial_load.py), then each
layer's tensors are read (models/tensor_files.py), converted to the form the model
computes with exactly as a whole load converts them, cut to this rank's heads and hidden
units (tensor_groups.cut_layer), and the whole tensors dropped before the next layer is
read. The embedding and an untied head are read by vocabulary rows only. The peak while
loading is this rank's slices plus one layer whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_unflatten

from ...errors import UserError
from ...models.checksum import model_checksum
from ...models.loader import LoadedModel
from ...models.partial_load import layer_prefix, open_skeleton, read_tensors
from ..layer_parts import head_counts
from .tensor_groups import cut_layer, head_shares
from .weight_slices import split_ranges


@dataclass
class TensorShareLoad(LoadedModel):
    """A loaded model cut to one TP rank's slices; ``vocab_rows``: the vocabulary rows
    its embedding (and untied head) hold."""

    vocab_rows: tuple = (0, 0)


def load_tensor_share(path: str, rank: int, size: int,
                      keep_quantized: bool = False) -> TensorShareLoad:
    """TP rank ``rank`` of ``size``: its slices of every layer, its vocabulary rows, the
    norms. UserError naming what cannot be cut (the same on every rank of the group)."""
    skeleton = open_skeleton(path, keep_quantized, f"--tp {size}")
    files, form, base, model = skeleton.files, skeleton.form, skeleton.base, skeleton.model
    wanted, config = skeleton.wanted, skeleton.config
    layers = model.model.layers
    try:
        share = head_shares(*head_counts(layers[0].self_attn), size)[rank]
    except ValueError as error:
        raise UserError(f"--tp {size}: {error}") from None
    for index, layer in enumerate(layers):
        prefix = layer_prefix(index, base)
        packed = read_tensors(files, [n for n in wanted if n.startswith(prefix)])
        whole = form.convert({n[len(prefix):]: a for n, a in packed.items()},
                             layer_prefix(index))
        layer.update(tree_unflatten(list(whole.items())))
        try:
            cut_layer(layer, share, rank, size)
        except (TypeError, ValueError) as error:
            raise UserError(f"--tp {size}: layer {index}: {error}") from None
        mx.eval(layer.parameters())  # its norms; the slices are evaluated copies already
        del packed, whole
    rows = split_ranges(config["vocab_size"], size)[rank]
    sliced = read_tensors(files, [n for n in wanted if n.startswith(
        (f"{base}model.embed_tokens.", f"{base}lm_head."))], rows=rows)
    sliced.update(files.read(f"{base}model.norm.weight"))
    model.update(tree_unflatten([(n[len(base):], a) for n, a in form.convert(sliced).items()]))
    mx.eval(model.parameters())
    model.eval()
    where = str(skeleton.path)
    return TensorShareLoad(model, skeleton.tokenizer, config, where, model_checksum(where),
                           vocab_rows=rows)
