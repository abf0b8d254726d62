"""Model loading: the float32 copy of a GGUF's weights kept between runs."""

from __future__ import annotations

import numpy as np
from mlx.utils import tree_flatten


def test_float32_weight_copy_is_written_reused_and_survives_damage(embedded_model, tmp_path,
                                                                   monkeypatch):
    from spmd_cp.models.loader import load_model

    monkeypatch.setenv("SPMD_CP_CACHE", str(tmp_path))
    first = dict(tree_flatten(load_model(embedded_model).model.parameters()))
    copies = list((tmp_path / "weights").glob("*.f32dq.safetensors"))
    assert len(copies) == 1 and copies[0].stat().st_size > 500e6
    second = dict(tree_flatten(load_model(embedded_model).model.parameters()))
    assert first.keys() == second.keys()
    for name in ("model.layers.7.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        np.testing.assert_array_equal(np.array(first[name]), np.array(second[name]))
    copies[0].write_bytes(b"not a safetensors file")  # damaged: dequantize again
    third = dict(tree_flatten(load_model(embedded_model).model.parameters()))
    np.testing.assert_array_equal(np.array(third["model.norm.weight"]),
                                  np.array(first["model.norm.weight"]))
    assert copies[0].stat().st_size > 500e6  # rewritten
    copies[0].unlink()  # --no-weight-cache: dequantized again, nothing written
    fourth = dict(tree_flatten(load_model(embedded_model, weight_cache=False).model.parameters()))
    np.testing.assert_array_equal(np.array(fourth["model.layers.7.self_attn.q_proj.weight"]),
                                  np.array(first["model.layers.7.self_attn.q_proj.weight"]))
    assert not list((tmp_path / "weights").iterdir())
