"""``--decode-tp auto``: split the decode step's weights across ranks or not. Pure.

A decode step reads every weight matrix once: on a CPU (and on a small GPU model) that
read is most of the step. The split step (tp_decode.py) has each rank read 1/N of every
matrix and adds three small collectives per layer (the q/k/v Allgather, the Allgather of
the attention output's rows, the Allreduce after the MLP) plus one Gatherv of the
logits. So

    saved per step = (1 - 1/N) * W / stream        cost per step = (3 L + 1) * t_coll

with W the bytes of the matrices the split divides, ``stream`` the weight bytes/s a
matrix-vector product reads on every rank at once (ranks sharing a memory bus slow each
other down, which the measurement includes) and t_coll one small collective as decode
issues it (evaluate, MPI, convert back; on a GPU that includes the device sync). Both
are measured once per set of hosts by calibrate.py and cached, so the decision costs no
decode steps. It replaced timing the first steps of each mode: three replicated and
three split steps (and building the slices either way) cost what the split gains over
that many steps, and two timings per mode were too few to see past other load.

Matrices decode reads in a packed form (quantized_shadows.py: a quantized model on an x86
CPU) do not take W / stream: their kernel is bound by its arithmetic, not the float32
bytes. Their time is measured when decode is readied (all their products once, every
rank at once, the slowest rank's; 10-30 ms) and replaces their share of W / stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx.utils import tree_flatten


@dataclass(frozen=True)
class SplitEstimate:
    split: bool
    saved_s: float  # weight-read time saved per step
    cost_s: float  # time the added collectives take per step
    reason: str


@dataclass(frozen=True)
class PackedReads:
    """Split matrices decode reads in a packed form instead (models/quantized_shadows.py):
    their float32 bytes, and the seconds one rank's products of all of them took,
    every rank at once (measured)."""

    float32_bytes: int
    seconds: float


def split_modules(model) -> list:
    """The modules whose matrices the split step divides: every layer's projections and
    MLP, and the vocabulary projection (the tied embedding if there is no separate head)."""
    from ..layer_parts import LayerParts  # reads mlx-lm's modules; the arithmetic stays pure

    modules = []
    for layer in model.layers:
        modules += LayerParts.of(layer).modules()
    head = model.lm_head if isinstance(model.lm_head, nn.Module) else model.embed_tokens
    return modules + [head]


def split_matrix_bytes(model) -> int:
    """Bytes of the matrices a decode step reads that the split step divides
    (``split_modules``; a quantized matrix counts its packed weights, scales and biases),
    and of a mixture's experts the share a token reads (its experts per token)."""
    from ..weights.expert_slices import expert_bytes, experts_per_token
    from ..layer_parts import LayerParts

    total = sum(v.nbytes for m in split_modules(model) for _, v in tree_flatten(m.parameters()))
    for parts in (LayerParts.of(layer) for layer in model.layers):
        mlp = parts.feed_forward
        if not parts.is_swiglu and hasattr(mlp, "num_experts"):  # not Gemma's GELU MLP
            total += expert_bytes(mlp) * experts_per_token(mlp) // mlp.num_experts
    return total


def split_copy_bytes(model, cp_size: int) -> int:
    """Bytes the split step copies on the busiest of ``cp_size`` ranks when the weights
    are replicated: its columns of every layer's down projection (of a mixture, its share
    of every expert), and of a small model the q/k/v rows of a rank whose rows span several
    of those matrices (the other row slices are views, tp_decode.py). 0 for one rank."""
    if cp_size == 1:
        return 0
    from ..weights.expert_slices import expert_bytes
    from ..layer_parts import LayerParts
    from .tp_decode import joined_qkv_bytes  # MLX graph code; this module stays pure

    parts = [LayerParts.of(layer) for layer in model.layers]
    modules = [p.down for p in parts if p.down is not None and not _stays_packed(p.down, cp_size)]
    total = sum(v.nbytes for m in modules for _, v in tree_flatten(m.parameters()))
    total += sum(expert_bytes(p.feed_forward) for p in parts
                 if not p.is_swiglu and hasattr(p.feed_forward, "switch_mlp"))
    joined = sum(joined_qkv_bytes(layer, cp_size) for layer, p in zip(model.layers, parts)
                 if not _stays_packed(p.qkv[0], None))
    return -(-total // cp_size) + joined


def _stays_packed(module, cp_size: int | None) -> bool:
    """Whether the split step's copy of ``module``'s weight (its columns cut for
    ``cp_size`` ranks; None: its rows) is released once registered, as a packed-only
    model's matrices are (models/packed_load.py): it then holds no float32 bytes."""
    from ...models.quantized_shadows import SHADOWS
    from ..weights.weight_slices import split_ranges

    weight = module.get("weight") if isinstance(module, dict) else None
    if weight is None or weight.ndim != 2 or not SHADOWS.is_released(weight):
        return False
    if cp_size is None:
        return True
    packed = SHADOWS.packed_of(weight)
    return packed is not None and all(packed.columns(a, b) is not None
                                      for a, b in split_ranges(weight.shape[1], cp_size))


def estimate_split(weight_bytes: int, cp_size: int, num_layers: int, stream_bytes_per_s: float,
                   collective_s: float, packed: PackedReads | None = None,
                   margin: float = 0.0) -> SplitEstimate:
    """Whether the split step pays on these ranks (see the module docstring); ``packed``:
    the share of the matrices read in a packed form, at its measured time instead of at
    the float32 read rate; ``margin``: the share by which the saving must exceed the
    cost."""
    if cp_size == 1:
        return SplitEstimate(False, 0.0, 0.0, "one rank: nothing to split")
    if stream_bytes_per_s <= 0:
        return SplitEstimate(False, 0.0, 0.0, "no measurement of the weight read rate")
    packed = packed or PackedReads(0, 0.0)
    plain = weight_bytes - packed.float32_bytes
    saved = (1 - 1 / cp_size) * (plain / stream_bytes_per_s + packed.seconds)
    cost = (3 * num_layers + 1) * collective_s
    split = saved > cost * (1 + margin)
    reads = f"{weight_bytes / 1e6:.0f} MB of matrices at {stream_bytes_per_s / 1e9:.1f} GB/s"
    if packed.float32_bytes:
        reads = (f"{weight_bytes / 1e6:.0f} MB of matrices: {plain / 1e6:.0f} MB at "
                 f"{stream_bytes_per_s / 1e9:.1f} GB/s, {packed.float32_bytes / 1e6:.0f} MB "
                 f"read packed in {1e3 * packed.seconds:.1f} ms")
    return SplitEstimate(split, saved, cost, (
        f"estimated per step: {1e3 * saved:.1f} ms of weight reads saved, "
        f"{1e3 * cost:.1f} ms in {3 * num_layers + 1} more collectives"
        f"{f' (+{100 * margin:.0f}% margin)' if margin else ''} "
        f"({reads}; {1e6 * collective_s:.0f} us per collective)"))
