"""Model files -> (mlx-lm model, tokenizer, config). Local files only, never the network.

Two formats: a GGUF file (the embedded SmolLM2 by default; see gguf.py) and an MLX /
Hugging Face directory (config.json, *.safetensors, tokenizer files) read through
mlx-lm's own loading functions. On the CPU backend weights are computed with as float32:
MLX's quantized matmul and half-precision matmul are 10-20x slower there than float32
through an optimized BLAS (docs/CPU_SPEED.md). Where decode follows and the BLAS forward
is preloaded (``packed_only``), quantized matrices are held packed only and turned into
float32 a tile at a time as products need them (packed_load.py, quantized_shadows.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..runtime.paths import cache_dir
from .checksum import model_checksum
from . import quantized_shadows
from ..errors import UserError
from .gguf_header import forget_layouts, read_gguf_tensors
from .safetensors_header import check_safetensors
from .shape import SLIDING_WINDOW_MODEL_TYPES, SUPPORTED_MODEL_TYPES, ModelShape, shape_of_config

# What reading damaged or foreign model files raises, in mlx-lm and MLX's loaders: such a
# failure is the files' fault, reported as a UserError naming them.
LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, IndexError)
MAX_ERROR_CHARS = 300  # of a loader's message in that one line


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    path: str
    checksum: str = ""  # sha256 of the model files (checksum.py)
    # The weight bytes the memory forecast counts, per (ranks, split decode): walking the
    # parameters took 37-82 ms at N = 2, and serve forecasts every request (run/memory.py).
    weight_bytes_by_layout: dict = field(default_factory=dict, init=False, repr=False,
                                         compare=False)

    @property
    def max_context(self) -> int | None:
        return self.config.get("max_position_embeddings")

    @property
    def shape(self) -> ModelShape:
        return shape_of_config(self.config)


def default_model_path() -> str:
    from .gguf import default_model_path as embedded

    try:
        return embedded()
    except FileNotFoundError as error:
        raise UserError(str(error)) from None


def check_model_path(path: str) -> Path:
    """Fail fast, before any heavy work, on a path that cannot be a model: also on a file
    cut short or not of its format (every tensor must lie inside its file)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"model not found: {path}")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise UserError(f"model file is not GGUF: {path} (pass a .gguf file or an "
                            "MLX/HF directory)")
        if not _readable(p):
            raise UserError(f"model file is not readable: {path}")
        _check_file(p, read_gguf_tensors)
        _check_tensor_types(p, path)
        return p
    if not (p / "config.json").is_file():
        raise UserError(f"model directory has no config.json: {path}")
    config = _read_json(p / "config.json", path)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"unsupported model architecture {model_type!r} in {path} "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _check_config(config, model_type, path)
    for weights in sorted(p.glob("*.safetensors")):
        _check_file(weights, check_safetensors)
    return p


def _check_config(config: dict, model_type: str, path: str):
    """Refuse a config.json mlx-lm cannot build its model from (a missing size, say)."""
    import importlib

    from mlx_lm.utils import MODEL_REMAPPING

    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    try:
        module.ModelArgs.from_dict(config)
    except (TypeError, ValueError, KeyError) as error:
        what = " ".join(str(error).split()).replace("ModelArgs.__init__() ", "")
        raise UserError(f"model directory {path} has an incomplete config.json: "
                        f"{what[:MAX_ERROR_CHARS]}") from None


def _check_tensor_types(p: Path, path: str):
    """Refuse a GGUF with a tensor of a type no reader here reads, naming both."""
    from .gguf_types import refusal

    _, infos = read_gguf_tensors(str(p))  # the header just checked (kept, not re-read)
    if why := refusal((info.name, info.ggml_type) for info in infos):
        raise UserError(f"cannot load model {path}: {why}")


def _check_file(file: Path, check):
    try:
        check(str(file))
    except (OSError, ValueError) as error:
        raise UserError(f"model file {file} is unusable: {error}") from None


def load_model(path: str, keep_quantized: bool = False, packed_decode: bool = True,
               weight_cache: bool = True, packed_only: bool = False) -> LoadedModel:
    """Check, then load a model; any failure to read its files is a UserError naming them.
    ``packed_decode``: register a quantized model's packed matrices for decode's products
    (models/quantized_shadows.py; False where no decode step follows, e.g. ``score``).
    ``weight_cache``: keep a GGUF's dequantized float32 weights on disk between runs
    (``float32_cache_path``; ``--no-weight-cache`` turns it off).
    ``packed_only``: with ``packed_decode``, hold a GGUF's quantized matrices (and an MLX
    directory's affine ones) packed only (packed_load.py; the float32 parameters of those
    matrices then hold no values: only spmd-cp's engine computes with such a model, not
    mlx-lm's forward)."""
    p = check_model_path(path)
    checksum = model_checksum(str(p))
    packed_only = packed_only and packed_decode and not keep_quantized and \
        quantized_shadows.available()
    try:
        if packed_only and p.is_file():
            from .packed_load import load_gguf_packed

            return LoadedModel(*load_gguf_packed(str(p)), str(p), checksum)
        return _load(p, keep_quantized, checksum, packed_decode, weight_cache, packed_only)
    except LOAD_ERRORS as error:
        what = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        what = " ".join(what.split())  # one line (mlx-lm lists missing weights one a line)
        if len(what) > MAX_ERROR_CHARS:
            what = what[:MAX_ERROR_CHARS] + "..."
        raise UserError(f"cannot load model {path}: {what}") from None
    finally:
        forget_layouts()


def _load(p: Path, keep_quantized: bool, checksum: str, packed_decode: bool,
          weight_cache: bool, packed_only: bool = False) -> LoadedModel:
    path = str(p)
    packed = {}  # {parameter name: Packed} of the matrices dequantized to float32
    if p.is_file():
        from .gguf import load_gguf

        cache = float32_cache_path(checksum) if weight_cache else None
        model, tokenizer, config = load_gguf(str(p), keep_quantized=keep_quantized,
                                             float32_cache=cache)
    else:
        from mlx_lm.utils import load_model as mlx_lm_load_model
        from mlx_lm.utils import load_tokenizer

        model, config = mlx_lm_load_model(p)
        tokenizer = load_tokenizer(p)
        _refuse_sliding_window(config, path)
        model, config = text_part(model, config)
        if not keep_quantized and mx.default_device() == mx.cpu:
            from mlx_lm.utils import dequantize_model

            packed = dequantize_affine_float32(model)
            model = dequantize_model(model)  # any other quantization mode
    if mx.default_device() == mx.cpu and not keep_quantized:
        model.set_dtype(mx.float32)
    if packed_only and packed:
        # An MLX directory's affine matrices held packed only: each dequantized, checked
        # against its packed form and released in turn, never all at once.
        quantized_shadows.SHADOWS.releasing = True
        quantized_shadows.register_model(model, packed)
        packed = {}
    mx.eval(model.parameters())
    if packed_decode and not keep_quantized and quantized_shadows.available():
        if p.is_file():
            from .gguf import packed_weights

            packed = packed_weights(path)
        quantized_shadows.register_model(model, packed)
    return LoadedModel(model, tokenizer, config, str(p), checksum)


def dequantize_affine_float32(model: nn.Module) -> dict:
    """Replace the model's affine-quantized Linear and Embedding layers by float32 ones
    whose weights are dequantized in float32 arithmetic (scales and biases widened first,
    as GGUF files are, models/gguf.py), and return {parameter name: Packed} of them.

    mlx-lm's dequantize_model computes in the scales' dtype, rounding every weight to
    bfloat16 or float16 on the way, which no float32 kernel over the packed form can
    reproduce; in float32 arithmetic the packed form is what decode reads instead
    (models/quantized_shadows.py). Other quantization modes are left to mlx-lm."""
    from mlx.utils import tree_unflatten

    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from .quantized_shadows import Packed

    replaced, packed = [], {}
    for name, module in model.named_modules():
        if getattr(module, "mode", "affine") != "affine":
            continue
        if isinstance(module, QuantizedSwitchLinear):  # stacked experts: no packed decode
            replaced.append((name, _dequantized_experts(module)))
            continue
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        form = Packed.of(module["weight"], module["scales"], module["biases"], module.bits,
                         module.group_size)
        weight = form.dequantized()
        if isinstance(module, nn.QuantizedLinear):
            dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                dense.bias = module["bias"]
        else:
            dense = nn.Embedding(weight.shape[0], weight.shape[1])
        dense.weight = weight
        replaced.append((name, dense))
        packed[f"{name}.weight"] = form
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return packed


def _dequantized_experts(module) -> nn.Module:
    """A mixture's QuantizedSwitchLinear (experts, out, in) as a float32 SwitchLinear,
    dequantized in float32 arithmetic as the dense matrices are."""
    from mlx_lm.models.switch_layers import SwitchLinear

    from .gguf import dequantize_float32

    weight = dequantize_float32(module["weight"], module["scales"], module["biases"],
                                module.bits, module.group_size)
    experts, out_width, in_width = weight.shape
    dense = SwitchLinear(in_width, out_width, experts, bias="bias" in module)
    if "bias" in module:
        dense.bias = module["bias"]
    dense.weight = weight
    return dense


def float32_cache_path(checksum: str) -> str:
    """Where the dequantized float32 weights of a GGUF file are kept between runs.

    Dequantizing on the CPU costs seconds per rank and per run (3 s for SmolLM2-135M);
    reading the float32 copy back costs a fraction of that (the copy takes 4 bytes per
    parameter of disk; ``--no-weight-cache`` does without it).
    """
    # "f32dq": dequantized in float32 arithmetic (gguf.dequantize_float32); copies named
    # "float32" were dequantized in float16 and are not read.
    return str(cache_dir() / "weights" / f"{checksum}.f32dq.safetensors")


def text_part(model: nn.Module, config: dict) -> tuple[nn.Module, dict]:
    """The language model of a multimodal checkpoint (gemma3's ``language_model``: its
    vision tower is dropped by mlx-lm's sanitize) and, for the families whose mlx-lm
    arguments fill in defaults the file may leave out (gemma3's head_dim, window, nested
    ``text_config``), the config with those arguments over it (its model_type kept)."""
    model = getattr(model, "language_model", model)
    args = getattr(model, "args", None)
    if config.get("model_type") in SLIDING_WINDOW_MODEL_TYPES and dataclasses.is_dataclass(args):
        config = {**config, **dataclasses.asdict(args), "model_type": config["model_type"]}
    return model, config


def _refuse_sliding_window(config: dict, path: str):
    if config.get("model_type") in SLIDING_WINDOW_MODEL_TYPES:
        return  # their windows run exactly (attention/window.py)
    kinds = set(config.get("layer_types") or [])
    if kinds - {"full_attention"} or config.get("use_sliding_window"):
        raise UserError(f"{path}: sliding-window attention layers are not supported "
                        "(context parallelism here is exact full attention)")


def _read_json(file: Path, path: str) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {file} of model {path}: {error}") from None


def _readable(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            f.read(4)
        return True
    except OSError:
        return False
