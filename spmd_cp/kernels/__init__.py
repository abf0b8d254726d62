"""The C kernels and their loaders: compiled with the system's C compiler on first use.

gemv_forward.c takes MLX's matrix-vector products ahead of the BLAS (and reads quantized
shadows); decode_step.c is the native decode step's work around those products. Each
``.py`` beside its ``.c`` builds and loads it (runtime/native.py) and mirrors its structs.
Standard library only: the forward is built before MLX or MPI load.
"""
