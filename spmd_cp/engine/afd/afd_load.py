"""One rank's part of a model under ``--afd``, read from its files a layer at a time.

An attention rank reads everything but the feed-forward (a mixture's router stays: it
routes where the rows are); an FFN rank reads the feed-forward only: its experts (the
stacked experts' rows [start, stop) along the expert axis) or, for a dense MLP, its
share of the hidden units (tensor_groups.cut_feed_forward), and no embedding, head or
attention. Each layer is read and converted whole, as a whole load converts it, then cut
and dropped: the peak while loading is a rank's part plus one layer read whole and the
part being cut from it (tests/test_afd.py: at most two layers' bytes above the part).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_unflatten

from ...errors import UserError
from ...models.checksum import model_checksum
from ...models.loader import LoadedModel
from ...models.partial_load import layer_prefix, open_skeleton, read_tensors
from ...runtime.afd import AfdRoles
from .afd_attention import expert_ranges, is_mixture, routing_obstacle
from .afd_ffn import FfnLayer
from ..weights.expert_slices import EXPERT_PROJECTIONS, experts_per_token
from ..layer_parts import LayerParts, feed_forward
from ..model import ReplicatedLayer
from ..weights.tensor_groups import cut_feed_forward


@dataclass
class AfdLoad(LoadedModel):
    """A rank's part under ``--afd``: ``ffn_layers`` on an FFN rank (its share of each
    layer's feed-forward), empty on an attention rank."""

    attention: bool = True
    ffn_layers: list = field(default_factory=list)


def load_afd_share(path: str, roles: AfdRoles, world_rank: int,
                   keep_quantized: bool = False) -> AfdLoad:
    """World rank ``world_rank``'s part of the model at ``path`` (UserError naming a
    layer whose feed-forward cannot be divided, the same on every rank)."""
    flag = f"--afd {roles.attention}:{roles.ffn}"
    skeleton = open_skeleton(path, keep_quantized, flag)
    files, form, base, model = skeleton.files, skeleton.form, skeleton.base, skeleton.model
    attention = roles.is_attention(world_rank)
    ffn_rank = world_rank - roles.attention
    ffn_layers = []
    for index, layer in enumerate(model.model.layers):
        mlp_name = next(n for n in ("mlp", "block_sparse_moe") if n in layer)
        why = routing_obstacle(feed_forward(layer), roles.ffn)
        if why:
            raise UserError(f"{flag}: layer {index}: {why}")
        prefix = layer_prefix(index, base)
        packed = read_tensors(files, [n for n in skeleton.wanted if n.startswith(prefix)])
        whole = form.convert({n[len(prefix):]: a for n, a in packed.items()},
                             layer_prefix(index))
        ours = {n: a for n, a in whole.items() if _wanted(n, mlp_name, attention)}
        layer.update(tree_unflatten(list(ours.items())))
        del packed, whole, ours
        if not attention:
            ffn_layers.append(_feed_forward_share(layer, ffn_rank, roles.ffn, index, flag))
        mx.eval(layer.parameters())
    config = skeleton.config
    if attention:
        vocab = read_tensors(files, [n for n in skeleton.wanted if n.startswith(
            (f"{base}model.embed_tokens.", f"{base}lm_head."))])
        vocab.update(files.read(f"{base}model.norm.weight"))
        model.update(tree_unflatten([(n[len(base):], a)
                                     for n, a in form.convert(vocab).items()]))
        mx.eval(model.parameters())
    model.eval()
    where = str(skeleton.path)
    return AfdLoad(model, skeleton.tokenizer, config, where, model_checksum(where),
                   attention=attention, ffn_layers=ffn_layers)


def _wanted(name: str, mlp_name: str, attention: bool) -> bool:
    """Whether a layer's tensor ``name`` (relative to the layer) is the rank's: all but
    the feed-forward on an attention rank, with a mixture's router (``gate``; a dense
    MLP's is ``gate_proj``); the feed-forward but the router on an FFN rank."""
    in_mlp = name.startswith(f"{mlp_name}.")
    router = name.startswith(f"{mlp_name}.gate.")
    return (not in_mlp or router) if attention else (in_mlp and not router)


def _feed_forward_share(layer, rank: int, size: int, index: int, flag: str) -> FfnLayer:
    """FFN rank ``rank``'s share of ``layer``'s feed-forward, as an FfnLayer (the
    layer's own module keeps nothing more than that share)."""
    mlp = feed_forward(layer)
    if is_mixture(mlp):
        start, stop = expert_ranges(mlp.num_experts, size)[rank]
        switch = mlp.switch_mlp
        for name in EXPERT_PROJECTIONS:
            piece = switch[name]
            for key in ("weight", "scales", "biases", "bias"):
                if key in piece:
                    piece[key] = mx.contiguous(piece[key][start:stop])
        mx.eval(switch.parameters())
        hidden = switch.down_proj["weight"].shape[1]
        return FfnLayer(switch, hidden, (start, stop), experts_per_token(mlp))
    try:
        cut_feed_forward(layer, LayerParts.of(layer), rank, size)
    except (TypeError, ValueError) as error:
        raise UserError(f"{flag}: layer {index}: {error}") from None
    # the MLP as one rank's layer loop computes it (model.ReplicatedLayer.mlp: a SwiGLU's
    # gate and up through the same products and activation, anything else mlx-lm's module)
    return FfnLayer(ReplicatedLayer(layer).mlp, _output_width(feed_forward(layer)))


def _output_width(mlp) -> int:
    """The model's hidden size, as the MLP's down projection writes it."""
    down = mlp.down_proj
    if "scales" in down:
        return down["scales"].shape[0]
    return down["weight"].shape[0]
