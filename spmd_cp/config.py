"""Typed settings of a run, with every default in one place (like mlx-lm's ModelArgs).

The CLI builds its flags from these classes (spmd_cp/cli/options.py) and its commands
build them from click's keyword arguments (``from_options``); everything below the CLI
receives these objects, never a dict of flags. Standard library only: the CLI module
that declares the flags imports this.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

DECODE_TP_MODES = ("auto", "on", "off")
DECODE_COMM_MODES = ("auto", "mlx", "mpi")
DECODE_STEP_MODES = ("auto", "native", "graph")
DECODE_REQUEST_MODES = ("persistent", "blocking")
GRAPH_BACKENDS = ("auto", "mpi", "ring")
SHARD_WEIGHTS_MODES = ("auto", "on", "off")
KV_DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "gpu", "cpu")
ATTENTION_KERNELS = ("auto", "fused", "tiled")

# Allowed values of the sampling settings as (lowest, highest); None: unbounded. The one
# declaration both the generate/batch flags and batch's job lines are checked against.
SAMPLING_RANGES = {
    "max_tokens": (0, None),
    "temp": (0, None),
    "top_p": (0, 1),
    "top_k": (0, None),
    "min_p": (0, 1),
    "seed": (0, 2**64 - 1),  # mx.random.seed takes an unsigned 64-bit integer
}


def in_range(name: str, value) -> bool:
    """Whether ``value`` (None: unset) is allowed for sampling setting ``name`` (a
    float must be finite: NaN and infinity are no setting)."""
    import math

    low, high = SAMPLING_RANGES[name]
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value is None or (value >= low and (high is None or value <= high))


def sampling_problem(sampling, vocab: int | None) -> str | None:
    """What the model makes of settings the ranges cannot judge alone (None: fine):
    top_k must be below the vocabulary (mlx-lm's sampler refuses the rest)."""
    if vocab and sampling.top_k and sampling.top_k >= vocab:
        return (f"top_k {sampling.top_k} is not below the model's vocabulary of {vocab} "
                f"tokens (0 turns top-k off)")
    return None


def describe_range(name: str) -> str:
    low, high = SAMPLING_RANGES[name]
    return f">= {low}" if high is None else f"in [{low}, {high}]"


class _Settings:
    @classmethod
    def default(cls, name: str):
        """The default of field ``name`` (what the CLI flag shows and falls back to)."""
        spec = next(f for f in fields(cls) if f.name == name)
        return spec.default_factory() if spec.default is MISSING else spec.default

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass(frozen=True)
class RunConfig(_Settings):
    """How every rank loads the model, prefills, and reports (generate, score, batch)."""

    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    cp_algo: str = "auto"
    # Tokens prefilled per chunk; 0: the whole prompt in one chunk; None: auto, decided
    # with the compute path (run/builder.py: mlx-lm's 2,048-token step on the GPU path at
    # one rank, else the whole prompt).
    prefill_chunk: int | None = None
    max_context: int | None = None  # None: the model's own limit
    # On the CPU dequantized float32 weights run much faster than quantized ones.
    keep_quantized: bool = False
    memory_limit: str | None = None  # None: this host's memory divided by its ranks
    # Layer-sharded weights (docs/SHARDED_WEIGHTS.md); auto: when the replicated weights
    # alone exceed memory_limit.
    shard_weights: str = "auto"
    # The KV cache's dtype on the CPU path (the GPU path keeps the model's): a half
    # precision one holds half the bytes a decode step reads, and is read into float32.
    # auto: float16 where the native decode step runs, else float32
    # (engine/decode_plan.choose_kv_dtype).
    kv_dtype: str = "auto"
    comm_timeout: float | None = None  # None: spmd.DEFAULT_COMM_TIMEOUT_S; 0 disables
    trace: str | None = None
    verbose: bool = False
    quiet: bool = False
    as_json: bool = False
    overwrite: bool = False
    # Control-token strings in the user's text become control tokens (else plain text).
    parse_special: bool = False
    # Decode reads a quantized model's 4/8-bit matrices packed (models/quantized_shadows.py)
    # on an x86 CPU, else their float32 copies.
    quantized_decode: bool = True
    # Attention's exp and the MLPs' SiLU as a compiled polynomial on x86 CPUs
    # (attention/exp.py), else MLX's own.
    fast_exp: bool = True
    # The compute path (runtime/device.py): gpu keeps the model's dtype for the KV cache
    # and messages and attends through MLX's fused kernel, cpu a tiled float32 attention;
    # auto: from MLX's default device. Forcing one tests the other path's exactness.
    device: str = "auto"
    # The attention kernel alone: fused (MLX's) or tiled (float32 blocks, float32 ring
    # partials); auto: fused on the GPU path, tiled on the CPU path.
    attention_kernel: str = "auto"
    # A GGUF's dequantized float32 weights kept on disk between runs (models/loader.py):
    # saves the dequantization, costs 4 bytes a parameter of disk.
    weight_cache: bool = True
    # Ranks per tensor-parallel group (runtime/grid.py): each holds 1/tp of every matrix;
    # the N / tp groups split the sequence.
    tp: int = 1
    # Attention-FFN disaggregation (runtime/afd.py): "A:F", A attention ranks (the CP
    # group, every KV) and F FFN ranks (the MLPs or experts), or None.
    afd: str | None = None
    # Micro-batches a layer's rows cross to the FFN ranks in (runtime/afd.py). One: on the
    # 2-core machine of docs/BENCHMARKS.md two measured no faster (the sides share the
    # cores, so there is none idle for the overlap).
    afd_micro_batches: int = 1
    fault: str | None = None  # test-only fault injection (runtime/faults.py; a hidden flag)


@dataclass
class SamplingConfig(_Settings):
    """Rank 0's sampling and when generation stops."""

    max_tokens: int = 256
    temp: float = 0.0  # 0: greedy
    top_p: float = 0.0  # 0: off (mlx-lm's make_sampler)
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # decode max_tokens tokens whatever the model ends with

    def __post_init__(self):
        self.stop = list(self.stop)


@dataclass(frozen=True)
class DecodeConfig(_Settings):
    """How the ranks share each decode step."""

    kv_interleave: int = 1
    decode_merge: str = "allgather"
    # auto: split when the cached calibration says it pays (engine/decode/decode_choice.py).
    decode_tp: str = "auto"
    # auto: the decode step's collectives run inside MLX's graph (runtime/graph_comm.py)
    # where every rank can open MLX's MPI or ring backend, else through mpi4py.
    decode_comm: str = "auto"
    # auto: the native step (C calls between persistent MPI collectives) where every rank
    # can run it, else MLX's graph; native: refuse to run without it; graph: MLX's graph.
    decode_step: str = "auto"
    # The native step's collectives: persistent MPI requests where the library has them
    # (else blocking calls), or blocking calls always.
    decode_requests: str = "persistent"
    # MLX's backend for graph collectives: auto tries its MPI backend (over this job's MPI
    # through the ABI adapter) and falls back to its ring backend; mpi or ring force one.
    graph_backend: str = "auto"


@dataclass(frozen=True)
class GenerateConfig(_Settings):
    """What `spmd-cp generate` reads and writes besides the shared settings."""

    prompt: str | None = None
    prompt_file: str | None = None
    system: str | None = None
    no_chat_template: bool = False
    save_cache: str | None = None
    load_cache: str | None = None


@dataclass(frozen=True)
class ScoreConfig(_Settings):
    text_file: str | None = None
    output: str | None = None


@dataclass(frozen=True)
class BatchConfig(_Settings):
    jobs_path: str | None = None
    output: str | None = None
    resume: bool = False
    system: str | None = None
    no_chat_template: bool = False
    progress_mode: str = "auto"
    max_batch: str = "auto"  # or a count: "1", "8", ...


@dataclass(frozen=True)
class ServeConfig(_Settings):
    """Where `spmd-cp serve` listens and whom it answers."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # None: no Authorization header asked for
    model_name: str | None = None  # the id /v1/models lists (None: the model file's name)
    cache_entries: int = 4  # conversations' KV caches kept resident (LRU)
    preload: tuple[str, ...] = ()  # --save-cache directories loaded as entries at start
    max_batch: int = 1  # requests decoded together (1: one request at a time)


def from_options(options: dict, *classes) -> tuple:
    """One instance of each settings class, taken from click's keyword arguments.

    Every option must belong to exactly one class: a flag nobody reads is a bug.
    """
    left = set(options)
    built = []
    for cls in classes:
        names = cls.names() & set(options)
        built.append(cls(**{name: options[name] for name in names}))
        left -= names
    if left:
        raise TypeError(f"options without a settings field: {sorted(left)}")
    return tuple(built)
