"""The CP model of a layer-sharded run: mlx-lm's modules with the layers in a
``LayerStore`` and a vocabulary-parallel embedding and head (``--shard-weights``)."""

from __future__ import annotations

from mlx.utils import tree_flatten

from ...runtime.comm import Comm
from ...runtime.device import Compute
from ..model import CPModel, first_layer_stand_in
from ...models.quantized_shadows import SHADOWS
from .tensor_groups import tensor_parallel
from .vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from .weights import LayerStore


def build_cp_model(loaded, comm: Comm, cpu_kv_dtype: str = "float32",
                   compute: Compute | None = None, tp: Comm | None = None,
                   vocab_rows: tuple[int, int] | None = None) -> CPModel:
    """``CPModel`` of a loaded model; layer-sharded when it was loaded as one rank's share
    (models/partial_load.py); over the TP group ``tp`` where the model was cut to this
    rank's slices and ``vocab_rows`` of the vocabulary (tensor_load.py).
    ``cpu_kv_dtype``: the KV cache's on the CPU path; ``compute``: the run's path and
    attention kernel (None: the default's)."""
    share = getattr(loaded, "share", None)
    inner = loaded.model.model
    if tp is not None:
        return tensor_parallel(CPModel(loaded.model, None, cpu_kv_dtype, compute), loaded,
                               tp, vocab_rows)
    # The KV dtype comes from running layer 0 on the GPU path (kv_dtype_for): a sharded
    # load's layers are placeholders, so lazy zeros of its computed form stand in.
    model = CPModel(loaded.model, first_layer_stand_in(loaded), cpu_kv_dtype, compute)
    if share is None:
        return model
    model.layers = LayerStore(list(inner.layers), share, comm)
    model.embed_tokens = VocabParallelEmbedding(inner.embed_tokens, share.vocab_rows, comm)
    head = getattr(loaded.model, "lm_head", None)
    project = head if head is not None else inner.embed_tokens.as_linear
    model.lm_head = VocabParallelHead(project, share.vocab_rows, comm)
    return model


def weight_bytes(model: CPModel, loaded) -> int:
    """Bytes of weights this rank holds at its peak: everything for a replicated model;
    for a sharded one its layers, its vocabulary rows, the norms and the largest window
    of other ranks' layers (and converted copies) the store held at once; the packed
    forms decode reads in place of float32 matrices (quantized_shadows.py), less the
    float32 matrices released for them (models/packed_load.py)."""
    held = SHADOWS.held_bytes(a for _, a in tree_flatten(loaded.model.parameters())) + \
        SHADOWS.nbytes
    store = model.layers
    if isinstance(store, LayerStore):
        held += store.share.owned_bytes() + store.peak_held_bytes
    return held
