"""Mistral: Llama's layers (mlx-lm runs it with llama.py); llama.cpp writes it as llama."""

from .family import Family

FAMILY = Family(name="Mistral", model_types=("mistral",), mlx_module="llama", mlp="swiglu")
