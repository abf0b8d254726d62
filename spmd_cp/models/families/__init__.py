"""The model families spmd-cp runs, one module each: what sets a family apart, in one place.

Each family module holds one ``Family``: the config ``model_type`` values mlx-lm builds it
from, its GGUF architecture and tensor names, its norms, RoPE and MLP form, its windows,
and what its GGUF metadata adds to the config. The loaders (models/gguf.py,
gguf_config.py, tensor_files.py, loader.py, shape.py), the GGUF vocabulary reader and the
layer forms (engine/layer_parts.py) ask ``by_model_type`` and ``of_gguf`` here rather than
naming families themselves, so adding a family is a module here and its line in
``FAMILIES``.
"""

from __future__ import annotations

from .family import Family
from . import gemma3, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe

# Where two families share a GGUF architecture, the more particular first (Mixtral is
# written as "llama" with experts).
FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                phi3.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, gemma3.FAMILY)
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)
GGUF_ARCHITECTURES = tuple(dict.fromkeys(f.gguf_arch for f in FAMILIES if f.gguf_arch))


def by_model_type(model_type: str | None) -> Family | None:
    """The family of a config's ``model_type`` (None: not one spmd-cp runs)."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    return None


def of_gguf(arch: str, tensor_names) -> Family:
    """The family of a GGUF file's ``general.architecture`` and tensors, or ValueError."""
    candidates = [f for f in FAMILIES if f.gguf_arch == arch]
    if not candidates:
        raise ValueError(f"unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    for family in sorted(candidates, key=lambda f: f.gguf_tensor is None):
        if family.gguf_tensor is None or family.gguf_tensor in tensor_names:
            return family
    raise ValueError(f"unsupported GGUF architecture {arch!r}")


__all__ = ["FAMILIES", "Family", "GGUF_ARCHITECTURES", "SUPPORTED_MODEL_TYPES",
           "by_model_type", "of_gguf"]
