"""One rank's share of a model for layer-sharded weights (``--shard-weights``).

Layer i belongs to rank i mod N; the embedding and an untied LM head are split by
vocabulary rows. A rank reads only those tensors' bytes (tensor_files.py) and builds
mlx-lm's model as a skeleton whose other parameters are empty placeholders, so no rank
ever holds, even transiently, more than its share. engine/weights/weights.py broadcasts each
layer from its owner before it runs.

Layers are kept "packed", as the file stores them (quantized triples stay quantized),
and converted to the form the model computes with (``ComputeForm``) only when a layer
is about to run: broadcasts carry the small packed form, and the conversion repeats
loader.py's exactly, so results equal the replicated run's bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from .checksum import model_checksum
from .loader import LoadedModel, _refuse_sliding_window, check_model_path, text_part
from .tensor_files import GGUFFile, open_tensor_files


@dataclass(frozen=True)
class ComputeForm:
    """How packed tensors become the module parameters (loader.load_model's rules)."""

    dequantize: bool  # quantized triples -> dense weights
    float32: bool  # floating tensors -> float32 (the CPU default)
    group_size: int = 32
    # (module path, group size) where the config quantizes a module otherwise than the
    # rest (mlx-lm's quant_predicate: a mixture's router at 8 bits in groups of 64)
    group_sizes: tuple = ()
    # GGUF and MLX directories' affine quantization: dequantized in float32 arithmetic
    # (gguf.dequantize_float32, loader.dequantize_affine_float32); other modes in their
    # scales' dtype, as mlx-lm's dequantize_model does.
    float32_arithmetic: bool = False

    def group_of(self, name: str) -> int:
        """The group size of parameter ``name`` (a full name: model.layers.3.mlp.gate.weight)."""
        return dict(self.group_sizes).get(name.rsplit(".", 1)[0], self.group_size)

    def convert(self, packed: dict, prefix: str = "") -> dict:
        """Packed {name: array} -> the parameters the modules compute with (``prefix``:
        what makes the names full, e.g. ``model.layers.3.`` for one layer's)."""
        from .gguf import dequantize_float32

        out = {}
        for name, array in packed.items():
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            if base is not None and f"{base}.scales" in packed:
                if not self.dequantize:
                    out[name] = array
                    continue
                scales, biases = packed[f"{base}.scales"], packed[f"{base}.biases"]
                group = self.group_of(prefix + name)
                bits = self.bits(array.shape, scales.shape, group)
                array = (dequantize_float32(array, scales, biases, bits, group)
                         if self.float32_arithmetic else
                         mx.dequantize(array, scales, biases, group_size=group,
                                       bits=bits))
            elif name.endswith((".scales", ".biases")) and self.dequantize:
                continue
            if self.float32 and array.dtype != mx.float32 and mx.issubdtype(array.dtype,
                                                                             mx.floating):
                array = array.astype(mx.float32)  # (a no-op astype would still copy)
            out[name] = array
        return out

    def bits(self, weight_shape, scales_shape, group_size: int) -> int:
        return weight_shape[-1] * 32 // (scales_shape[-1] * group_size)


@dataclass
class RankShare:
    """What one rank holds of a layer-sharded model besides the skeleton."""

    rank: int
    size: int
    form: ComputeForm
    layers: dict = field(default_factory=dict)  # owned index -> packed {relative name: array}
    layer_specs: list = field(default_factory=list)  # every layer: {name: (shape, dtype)}
    vocab_rows: tuple = (0, 0)

    def owner(self, layer: int) -> int:
        return layer % self.size

    def owned_bytes(self) -> int:
        return sum(a.nbytes for params in self.layers.values() for a in params.values())


@dataclass
class ShardedLoad(LoadedModel):
    share: RankShare | None = None


def vocab_rows(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous slice of the vocabulary (sizes differ by at most one)."""
    bounds = np.linspace(0, vocab, size + 1).round().astype(int)
    return int(bounds[rank]), int(bounds[rank + 1])


def layer_prefix(index: int, base: str = "") -> str:
    return f"{base}model.layers.{index}."


def text_prefix(config: dict) -> str:
    """Where a checkpoint keeps its language model's tensors: under ``language_model.``
    where it nests the text model's config (a multimodal gemma3), else at the top."""
    return "language_model." if "text_config" in config else ""


def read_config(files, path: Path, tokenizer: bool = True) -> tuple[dict, object]:
    """(HF-style config, tokenizer or None) from the file headers and tokenizer files."""
    if isinstance(files, GGUFFile):
        from .gguf import header_config

        try:
            return header_config(files, tokenizer)
        except ValueError as error:
            raise UserError(f"{path}: {error}") from None
    from mlx_lm.utils import load_config, load_tokenizer

    config = load_config(path)
    _refuse_sliding_window(config, str(path))
    return config, load_tokenizer(path) if tokenizer else None


def compute_form(files, config: dict, keep_quantized: bool) -> ComputeForm:
    on_cpu = mx.default_device() == mx.cpu
    if isinstance(files, GGUFFile):  # gguf.load_gguf dequantizes on every device
        return ComputeForm(dequantize=not keep_quantized, float32=not keep_quantized,
                           float32_arithmetic=True)
    quantization = config.get("quantization") or {}
    group = quantization.get("group_size", 64)
    convert = on_cpu and not keep_quantized
    # affine: in float32 arithmetic, as loader.dequantize_affine_float32 (other modes
    # as mlx-lm's dequantize_model)
    affine = quantization.get("mode", "affine") == "affine"
    overrides = tuple((path, q.get("group_size", group)) for path, q in quantization.items()
                      if isinstance(q, dict))
    return ComputeForm(dequantize=convert, float32=convert, group_size=group,
                       group_sizes=overrides,
                       float32_arithmetic=convert and affine)


def build_skeleton(config: dict, specs: dict, form: ComputeForm) -> nn.Module:
    """mlx-lm's model with every parameter an empty placeholder (nothing materialized:
    the constructor's random initial weights are lazy and are dropped unevaluated)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config=config)
    model = model_class(args_class.from_dict(config))
    if not form.dequantize:
        bits = {name[: -len(".scales")]: form.bits(specs[name[:-7] + ".weight"][0], shape,
                                                   form.group_of(name))
                for name, (shape, _) in specs.items() if name.endswith(".scales")}
        nn.quantize(model, class_predicate=lambda p, m: p in bits
                    and {"group_size": form.group_of(f"{p}.weight"), "bits": bits[p]})
    dtypes = {name: dtype for name, (_, dtype) in specs.items()}
    placeholders = [(name, mx.zeros((0,), _compute_dtype(dtypes.get(name, a.dtype), form)))
                    for name, a in tree_flatten(model.parameters())]
    model.update(tree_unflatten(placeholders))
    return model


def _compute_dtype(dtype, form: ComputeForm):
    if form.float32 and mx.issubdtype(dtype, mx.floating):
        return mx.float32
    return dtype


@dataclass
class Skeleton:
    """A model's files opened and mlx-lm's model built of empty placeholders: what a
    rank's share is then read into (``--shard-weights`` here, ``--tp``'s
    engine/weights/tensor_load.py)."""

    path: Path
    files: object  # tensor_files.GGUFFile or the safetensors files
    config: dict  # the text model's
    tokenizer: object
    specs: dict  # {file tensor name: (shape, dtype)}
    form: ComputeForm
    base: str  # where the language model's tensors sit in the files (text_prefix)
    model: nn.Module  # the text model, parameters empty
    wanted: set  # the file's tensors the model uses


def open_skeleton(path: str, keep_quantized: bool, flag: str) -> Skeleton:
    """The ``Skeleton`` of the model at ``path``; ``flag``: the option that reads shares
    (named where stored experts cannot be read one by one)."""
    p = check_model_path(path)
    files = open_tensor_files(str(p))
    config, tokenizer = read_config(files, p)
    specs = files.specs()
    form = compute_form(files, config, keep_quantized)
    base = text_prefix(config)
    skeleton = build_skeleton(config, specs, form)
    wanted = wanted_tensors(files, skeleton)
    model, config = text_part(skeleton, config)
    if "lm_head" in model and not any(n.startswith(f"{base}lm_head.") for n in specs):
        model.sanitize({})  # a head the files lack is the tied embedding (gemma3_text's rule)
    refuse_unstacked_experts(wanted, p, flag)
    return Skeleton(p, files, config, tokenizer, specs, form, base, model, wanted)


def load_rank_share(path: str, rank: int, size: int, keep_quantized: bool = False) -> ShardedLoad:
    """Rank ``rank`` of ``size``: its layers, vocabulary rows and the final norm."""
    s = open_skeleton(path, keep_quantized, "--shard-weights")
    p, files, config, tokenizer, specs, form, base, model, wanted = (
        s.path, s.files, s.config, s.tokenizer, s.specs, s.form, s.base, s.model, s.wanted)
    share = RankShare(rank, size, form, vocab_rows=vocab_rows(config["vocab_size"], rank, size))
    for index in range(config["num_hidden_layers"]):
        prefix = layer_prefix(index, base)
        names = [n for n in specs if n.startswith(prefix)]
        share.layer_specs.append({n[len(prefix):]: specs[n] for n in names})
        if share.owner(index) == rank:
            share.layers[index] = {n[len(prefix):]: a for n, a in
                                   read_tensors(files, [n for n in names if n in wanted]).items()}
    # The vocabulary slices go into the skeleton's own embedding (and untied head) modules.
    sliced = read_tensors(files, [n for n in wanted
                               if n.startswith((f"{base}model.embed_tokens.", f"{base}lm_head."))],
                       rows=share.vocab_rows)
    sliced.update(files.read(f"{base}model.norm.weight"))
    params = [(n[len(base):], a) for n, a in form.convert(sliced).items()]
    model.update(tree_unflatten(params))
    mx.eval([a for params in share.layers.values() for a in params.values()],
            [a for _, a in params])
    model.eval()
    return ShardedLoad(model, tokenizer, config, str(p), model_checksum(str(p)), share=share)


def wanted_tensors(files, model: nn.Module) -> set:
    """The file's tensors the model uses (not e.g. a tied head's copy or rotary tables);
    a quantized weight's scales and biases go with it even when it will be dequantized.
    A mixture's experts stored one by one (``experts.N.``: a Hugging Face checkpoint,
    which mlx-lm stacks as it loads) count whole."""
    modules = {name.rsplit(".", 1)[0] for name, _ in tree_flatten(model.parameters())}
    return {n for n in files.specs() if n.rsplit(".", 1)[0] in modules or ".experts." in n}


def refuse_unstacked_experts(wanted: set, path: Path, flag: str):
    if any(".experts." in n for n in wanted):
        raise UserError(f"{path}: the experts are stored one by one (a Hugging Face "
                        f"checkpoint); {flag} reads them stacked, as mlx-lm saves "
                        "a model (mlx_lm.convert)")


def read_tensors(files, names, rows=None) -> dict:
    """Read each tensor once (a GGUF quantized weight brings its scales and biases)."""
    readable = set(files.names) if isinstance(files, GGUFFile) else set(files.entries)
    out = {}
    for name in sorted(names):
        if name in readable and name not in out:
            out.update(files.read(name, rows=rows))
    return out


@dataclass
class WeightLayout:
    """Bytes of a model's weights by part, from the file headers (nothing read)."""

    layers_packed: list  # per layer, as held and broadcast
    layers_compute: list  # per layer, as the modules compute with it
    vocab: int  # embedding and untied head, as computed with
    other: int  # the final norm
    shadows: int = 0  # packed forms decode reads instead (a replicated quantized model)
    released: int = 0  # float32 matrices a packed-only replicated load does not hold

    @property
    def replicated(self) -> int:
        return sum(self.layers_compute) + self.vocab + self.other + self.shadows - \
            self.released

    def per_rank(self, ranks: int, prefetch: int) -> int:
        """Peak weight bytes on the busiest of ``ranks`` ranks with layer sharding: its
        own layers and vocabulary rows, the running layer and ``prefetch`` in flight,
        and, when packed and computed forms differ, two converted copies: the running
        layer's, and the previous layer's projections after the attention's collective,
        which the next collective evaluates (SmolLM2 Q4_1: MLX peak 120 MiB at N = 2,
        79 at N = 4, against 106 and 63 forecast with one copy)."""
        if ranks <= 1:
            return self.replicated
        owned = max(sum(self.layers_packed[r::ranks]) for r in range(ranks))
        window = (prefetch + 1) * max(self.layers_packed)
        if self.layers_compute != self.layers_packed:
            window += 2 * max(self.layers_compute)
        return owned + window + -(-self.vocab // ranks) + self.other


def _compute_bytes(specs: dict, names, form: ComputeForm) -> int:
    total = 0
    for name in names:
        shape, dtype = specs[name]
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in specs and form.dequantize:
            scales_shape, scales_dtype = specs[f"{base}.scales"]
            values = math.prod(shape) * 32 // form.bits(shape, scales_shape,
                                                        form.group_of(name))
            total += values * (4 if form.float32 else scales_dtype.size)
        elif name.endswith((".scales", ".biases")) and form.dequantize:
            continue
        else:
            total += math.prod(shape) * _compute_dtype(dtype, form).size
    return total


def weight_layout(path: str, keep_quantized: bool = False,
                  packed_decode: bool = True) -> WeightLayout:
    """The ``WeightLayout`` of a model file or directory, as load_model would hold it."""
    p = check_model_path(path)
    files = open_tensor_files(str(p))
    config, _ = read_config(files, p, tokenizer=False)
    specs = files.specs()
    form = compute_form(files, config, keep_quantized)
    skeleton = build_skeleton(config, specs, form)
    wanted = wanted_tensors(files, skeleton)
    base = text_prefix(config)
    _, text_config = text_part(skeleton, config)  # the layer count, defaults filled in
    packed, compute = [], []
    for index in range(text_config["num_hidden_layers"]):
        names = [n for n in wanted if n.startswith(layer_prefix(index, base))]
        packed.append(sum(math.prod(specs[n][0]) * specs[n][1].size for n in names))
        compute.append(_compute_bytes(specs, names, form))
    vocab = [n for n in wanted if n.startswith((f"{base}model.embed_tokens.", f"{base}lm_head."))]
    other = [n for n in wanted if not n.startswith((f"{base}model.layers.",
                                                    f"{base}model.embed_tokens.",
                                                    f"{base}lm_head."))]
    return WeightLayout(packed, compute, _compute_bytes(specs, vocab, form),
                        _compute_bytes(specs, other, form),
                        _shadow_bytes(specs, form, files) if packed_decode else 0,
                        _released_bytes(specs, form, files) if packed_decode else 0)


def _shadow_bytes(specs: dict, form: ComputeForm, files) -> int:
    """Bytes of the packed forms a replicated load registers as quantized shadows
    (models/quantized_shadows.py: a GGUF's matrices as the file's blocks; an MLX
    directory's affine ones as the packed words, the scales and biases as stored)."""
    from . import quantized_shadows

    if not (form.float32_arithmetic and form.dequantize and form.float32) or \
            not quantized_shadows.available():
        return 0
    blocks = files.block_shadows()
    total = sum(blocks.values())
    if not quantized_shadows.reads_affine():
        return total
    for name, (shape, dtype) in specs.items():
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is None or f"{base}.scales" not in specs or name in blocks:
            continue
        scales_shape, scales_dtype = specs[f"{base}.scales"]
        if len(shape) != 2:  # a mixture's stacked experts: dequantized, not read packed
            continue
        if form.bits(shape, scales_shape, form.group_of(name)) in quantized_shadows.KERNEL_BITS:
            kept = scales_dtype.size if scales_dtype in quantized_shadows.GROUP_KINDS else 4
            total += math.prod(shape) * dtype.size + 2 * kept * math.prod(scales_shape)
    return total


def _released_bytes(specs: dict, form: ComputeForm, files) -> int:
    """Float32 bytes of the matrices a replicated load holds packed only (the file's
    blocks, models/packed_load.py; MLX's affine triples): those ``_shadow_bytes``
    counts, at 4 bytes a weight."""
    from . import gguf_types, quantized_shadows
    from .tensor_files import GGUFFile

    if not _shadow_bytes(specs, form, files):
        return 0
    if isinstance(files, GGUFFile):
        return sum(4 * math.prod(info.shape)
                   for info in (files.infos[g] for g in files.names.values())
                   if len(info.shape) == 2 and
                   gguf_types.name_of(info.kind) in quantized_shadows.BLOCK_TYPES)
    total = 0
    for name, (shape, _) in specs.items():
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is None or f"{base}.scales" not in specs or len(shape) != 2 or \
                not quantized_shadows.reads_affine():
            continue
        bits = form.bits(shape, specs[f"{base}.scales"][0], form.group_of(name))
        if bits in quantized_shadows.KERNEL_BITS:
            total += 4 * shape[0] * shape[1] * 32 // bits
    return total
