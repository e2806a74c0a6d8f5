"""Typed config schemas: one dataclass per config group, and :class:`AppConfig` that holds them.

Hydra merges every ``configs/<group>/*.yaml`` into these types (see ``store.py``), so a yaml key
the schema lacks or a value of the wrong type fails at composition. Range checks run when the
dataclasses are built (``__post_init__``) and name the key as it is written on the command line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from deepinfer.hal.ops.sampling import FILTER_ORDERS

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""Activation dtypes a model config may name (``torch.<name>``)."""


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; the message says which key and why."""


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}")


@dataclass
class ModelConfig:
    """Which model to run: a preset under ``configs/model/`` or a checkpoint directory."""

    name: str = "tiny"
    """Preset name, used in logs and result files."""
    arch: str = "deepseek_v41"
    """Architecture key of ``deepinfer.models.registry``."""
    checkpoint: Optional[str] = None
    """Checkpoint directory (safetensors + config.json); None runs random weights."""
    dtype: str = "float32"
    """Activation dtype, one of ``DTYPE_NAMES``."""
    max_model_len: int = 1024
    """Longest sequence (prompt + output) the engine accepts; bounds the RoPE tables."""
    weight_format: Optional[str] = None
    """How the weights the official checkpoint quantizes are held in memory: None in ``dtype``;
    ``mxfp4`` as the checkpoint stores them (projections FP8 e4m3, routed experts MXFP4, UE8M0
    scales per 32 along K); ``fp8`` with the routed experts FP8 too. The GEMMs then read them
    quantized."""
    expert_activation_format: Optional[str] = None
    """What the experts' GEMMs (routed and shared) take as activations: None the model dtype;
    ``fp8`` e4m3 with UE8M0 scales per 32, as DeepInfer's FP8 x FP4 expert compute casts them (the
    expert inputs, and the SwiGLU's float32 products ahead of the down projections). ``fp8``
    needs ``weight_format``. It differs from DeepInfer in one rounding: the router weights
    multiply the routed down projection's output at the combine, where DeepInfer scales the
    SwiGLU output before its cast."""
    config: Dict[str, Any] = field(default_factory=dict)
    """HF ``config.json`` architecture keys; a checkpoint's config.json overrides them."""

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPE_NAMES, "model.dtype", self.dtype, f"use one of {list(DTYPE_NAMES)}")
        _require(self.max_model_len >= 1, "model.max_model_len", self.max_model_len, "must be >= 1")
        _require(self.weight_format in (None, "fp8", "mxfp4"), "model.weight_format", self.weight_format,
                 "use null (weights in model.dtype), fp8 or mxfp4")
        _require(self.expert_activation_format in (None, "fp8"), "model.expert_activation_format",
                 self.expert_activation_format, "use null (activations in model.dtype) or fp8")
        _require(self.expert_activation_format is None or self.weight_format is not None,
                 "model.expert_activation_format", self.expert_activation_format,
                 "fp8 expert activations feed block-scaled expert GEMMs: set model.weight_format=fp8 or mxfp4 too")

    @property
    def torch_dtype(self):
        """``dtype`` as a ``torch.dtype``."""
        import torch

        return getattr(torch, self.dtype)


@dataclass
class BackendConfig:
    """Which HAL backend runs the ops (names and ops are checked when the op table is built)."""

    name: str = "reference"
    """Backend serving every op, e.g. reference, sm100, ascend950."""
    device: str = "cpu"
    """torch device the model and caches live on."""
    fallback: Optional[str] = None
    """Backend for ops the chosen one lacks; None makes a missing op an error."""
    overrides: Dict[str, str] = field(default_factory=dict)
    """Per-op backend choice (op name -> backend name), for bisecting parity problems."""
    options: Dict[str, Any] = field(default_factory=dict)
    """The chosen backend's kernel choices, checked by its typed options (sm100:
    ``mla_kernel`` = auto | warp_specialized | portable, ``linear_kernel`` = auto | tilelang | cublas,
    ``quant_gemm`` = exact | native, ``tcgen05`` = false | true; ascend950: ``platform`` = A5 | A3 |
    A2); e.g. ``+backend.options.mla_kernel=portable``."""
    execution: str = "native"
    """``native`` runs the backend's kernels on its device; ``emulate`` runs its CPU emulation of
    them (backends that offer one, e.g. ascend950), with the model on the CPU whatever ``device``
    says."""

    def __post_init__(self) -> None:
        _require(self.execution in ("native", "emulate"), "backend.execution", self.execution,
                 "use native or emulate")
        if self.execution == "emulate":
            self.device = "cpu"

    @property
    def op_options(self) -> dict[str, Any]:
        """``options`` as the backend takes them, with ``execution`` when it emulates."""
        return {**self.options, **({"execution": "emulate"} if self.execution == "emulate" else {})}


@dataclass
class ParallelConfig:
    """How the work is spread over ranks: attention DP, expert EP, prefill CP."""

    name: str = "single"
    """Preset name."""
    data_parallel: int = 1
    """Attention data-parallel ranks."""
    expert_parallel: int = 1
    """Ranks the routed experts are spread over."""
    context_parallel: int = 1
    """Ranks a long prefill is split over (balanced, 2*cp pieces)."""
    world_size: Optional[int] = None
    """Processes the plan runs on; None: its largest dimension. 1 runs a plan of several ranks on
    one process (``torchrun --nproc-per-node 1``) with every group it names joined through the
    device's collective backend: a check of the launch path and the collectives on one device,
    not a scaling run."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for the other ranks before the run ends with an error."""
    num_extra_experts: int = 0
    """EPLB's redundant experts per MoE layer (physical experts = routed + these, split evenly over
    the expert-parallel ranks); 0: no EPLB, each rank a contiguous share of the experts."""
    eplb_interval: int = 0
    """Engine steps between EPLB's re-placements of the replicas (0: never, the static placement)."""
    eplb_window: int = 100
    """Steps of routed-token counts EPLB's policy reads."""

    def __post_init__(self) -> None:
        for key in ("data_parallel", "expert_parallel", "context_parallel"):
            value = getattr(self, key)
            _require(value >= 1, f"parallel.{key}", value, "must be >= 1")
        dims = max(self.data_parallel, self.expert_parallel, self.context_parallel)
        _require(self.world_size in (None, 1, dims), "parallel.world_size", self.world_size,
                 f"use {dims} (the plan's ranks), 1 (the plan's groups on one process) or null")
        _require(self.timeout_s > 0, "parallel.timeout_s", self.timeout_s, "must be > 0")
        _require(self.num_extra_experts >= 0, "parallel.num_extra_experts", self.num_extra_experts, "must be >= 0")
        _require(self.eplb_interval >= 0, "parallel.eplb_interval", self.eplb_interval, "must be >= 0 (0: never)")
        _require(self.eplb_window >= 1, "parallel.eplb_window", self.eplb_window, "must be >= 1")
        _require(not self.num_extra_experts or self.expert_parallel > 1, "parallel.num_extra_experts",
                 self.num_extra_experts, "needs expert parallelism (parallel.expert_parallel > 1)")
        _require(not self.eplb_interval or self.num_extra_experts, "parallel.eplb_interval", self.eplb_interval,
                 "re-places redundant experts: set parallel.num_extra_experts too")


@dataclass
class DecodingConfig:
    """Default sampling of a run, and DSpark speculative decoding."""

    name: str = "greedy"
    """Preset name."""
    temperature: float = 0.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 1 keeps everything."""
    top_k: int = -1
    """Most likely tokens kept; -1 (any value <= 0) keeps all."""
    filter_order: str = "deepinfer"
    """How top-p and top-k combine (``deepinfer.hal.ops.sampling.filter_mask``): ``deepinfer``
    (DeepInfer 0.1.0's order: top-p on the full softmax, then exactly ``top_k`` tokens, a tie at
    the k-th value going to the lower token id) or ``vllm`` (top-k keeping every tie at the k-th
    value, renormalise, then top-p keeping every tie at its threshold). It filters every request's
    target distribution, which DSpark verification accepts drafts against; the draft pass
    samples in the op's default order (deepinfer)."""
    force_topk: int = 0
    """Every draw keeps at most this many tokens (DeepInfer's sampler force-top-k): a request's
    ``top_k`` of -1 or 0 becomes this, a larger one is capped at it; target draws, the target
    distributions DSpark verifies against and the draft draws alike. 0: off."""
    max_tokens: int = 64
    """Output tokens per request at most."""
    seed: Optional[int] = None
    """Per-request sampling seed (counter-based RNG); None draws one per request."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    num_draft_tokens: int = 0
    """DSpark draft tokens per step; 0 turns speculative decoding off."""
    varlen: bool = False
    """DSpark confidence-scheduled verify lengths (False verifies every draft token)."""
    verify_cost: str = "deepinfer"
    """What varlen prices a verify step of N rows at: ``deepinfer`` (baseline + slope x the padded
    size N runs as, the slope the median of live per-step estimates) or ``measured`` (the warm-up
    measurement, interpolated)."""
    confidence_temperature: float = 1.0
    """Temperature of the DSpark confidence head."""
    confidence_temperatures: Optional[list[float]] = None
    """One confidence-head temperature per draft step (``num_draft_tokens`` of them), as
    DeepInfer's comma list allows; None uses ``confidence_temperature`` at every step."""

    @property
    def confidence_temperature_per_step(self) -> float | tuple[float, ...]:
        """The confidence-head temperature the draft pass takes: one, or one per draft step."""
        return tuple(self.confidence_temperatures) if self.confidence_temperatures else self.confidence_temperature

    def __post_init__(self) -> None:
        _require(self.temperature >= 0, "decoding.temperature", self.temperature, "must be >= 0 (0 is greedy)")
        _require(0 < self.top_p <= 1, "decoding.top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= -1, "decoding.top_k", self.top_k, "must be >= -1 (-1 or 0 disables it)")
        _require(self.filter_order in FILTER_ORDERS, "decoding.filter_order", self.filter_order,
                 f"use one of {list(FILTER_ORDERS)}")
        _require(self.force_topk >= 0, "decoding.force_topk", self.force_topk, "must be >= 0 (0: off)")
        _require(self.max_tokens >= 1, "decoding.max_tokens", self.max_tokens, "must be >= 1")
        _require(self.seed is None or 0 <= self.seed < 2**64, "decoding.seed", self.seed,
                 "must be null or an unsigned 64-bit integer")
        _require(self.num_draft_tokens >= 0, "decoding.num_draft_tokens", self.num_draft_tokens,
                 "must be >= 0 (0 turns DSpark off)")
        _require(self.verify_cost in VERIFY_COSTS, "decoding.verify_cost", self.verify_cost,
                 f"use one of {list(VERIFY_COSTS)}")
        _require(self.confidence_temperature > 0, "decoding.confidence_temperature",
                 self.confidence_temperature, "must be > 0")
        per_step = self.confidence_temperatures
        _require(per_step is None or (len(per_step) == self.num_draft_tokens and all(t > 0 for t in per_step)),
                 "decoding.confidence_temperatures", per_step,
                 f"must be null or num_draft_tokens ({self.num_draft_tokens}) temperatures, each > 0")


BOUNDED_REPLAY_MODES = ("off", "mask", "compact")
"""``engine.bounded_replay.mode`` values."""


VERIFY_COSTS = ("deepinfer", "measured")
"""``decoding.verify_cost`` values."""
SCHEDULERS = ("default", "deepinfer")
"""``engine.scheduler`` values."""
SEED_SCOPES = ("request", "sampling_params")
"""``engine.seed_scope`` values."""


@dataclass
class BoundedReplayConfig:
    """SWA bounded replay (YOCO prefill truncation): the YOCO consumer layers process and see only
    the last ``keep_tokens`` tokens of each prompt. It approximates a full prefill; ``mask``
    computes every row with the visibility ``compact`` has, and serves to check it."""

    mode: str = "off"
    """``off`` (full prefill), ``mask`` (every row, bounded visibility) or ``compact`` (kept rows only)."""
    keep_tokens: int = 140
    """Prompt tokens the consumer layers keep; at least the model's window + max_backtracking."""

    def __post_init__(self) -> None:
        _require(self.mode in BOUNDED_REPLAY_MODES, "engine.bounded_replay.mode", self.mode,
                 f"use one of {list(BOUNDED_REPLAY_MODES)} (quote \"off\" in yaml files, where bare off means false)")
        _require(self.keep_tokens >= 1, "engine.bounded_replay.keep_tokens", self.keep_tokens, "must be >= 1")


@dataclass
class StructuredConfig:
    """Grammar compilation for structured outputs (``SamplingParams(structured=...)``)."""

    compile_timeout_s: float = 20.0
    """A grammar still compiling this long after a worker started it fails its request alone (time
    queued behind other compiles does not count); its worker is killed and replaced."""
    compile_workers: int = 2
    """Worker processes compiling grammars (one thread each)."""
    backend: str = "auto"
    """Which library compiles and enforces grammars: ``xgrammar``, ``llguidance``, or ``auto``
    (per JSON schema, the one that leaves fewer of its keywords to validation, llguidance on a
    tie, the other when that one refuses the schema; regex and EBNF, in xgrammar's GBNF
    dialect, go to xgrammar). Under llguidance, EBNF is translated from GBNF to Lark."""
    any_whitespace: bool = False
    """JSON schemas allow any whitespace between tokens; false fixes the separators to ``", "``
    and ``": "`` (no runaway whitespace)."""
    retries: int = 0
    """A JSON output its schema rejects (a keyword the grammar cannot enforce) is generated again
    from the prompt with another seed, up to this many times; 0 ends the request "error"."""

    def __post_init__(self) -> None:
        _require(self.compile_timeout_s > 0, "engine.structured.compile_timeout_s", self.compile_timeout_s, "must be > 0")
        _require(self.retries >= 0, "engine.structured.retries", self.retries, "must be >= 0")
        _require(self.compile_workers >= 1, "engine.structured.compile_workers", self.compile_workers, "must be >= 1")
        _require(self.backend in ("auto", "xgrammar", "llguidance"), "engine.structured.backend", self.backend,
                 "must be one of auto, xgrammar, llguidance")


@dataclass
class EngineConfig:
    """Scheduler and cache sizes, and the engine's execution switches."""

    max_num_seqs: int = 32
    """Sequences running at once at most."""
    max_num_batched_tokens: int = 1024
    """Tokens in one step at most (prefill chunks plus decode tokens)."""
    prefill_chunk_tokens: int = 256
    """Longest prefill chunk of one sequence in a step."""
    num_kv_blocks: Optional[int] = None
    """Paged KV blocks to allocate; None sizes them: from a profiled worst-case step and
    gpu_memory_utilization on a GPU, from max_num_seqs and max_model_len on the CPU."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory the engine may fill (weights, activations, graphs, KV cache)."""
    cuda_graphs: Optional[bool] = None
    """Replay decode, verify and draft steps from CUDA graphs captured at start-up, per padded
    batch size; None: on for CUDA devices. false runs the same padded steps eagerly
    (debugging; the same tokens); true on the CPU runs them eagerly too (the CPU's default
    runs each step at its own size)."""
    seed: int = 0
    """Seed of weight initialisation and of per-request seeds not given."""
    scheduler: str = "default"
    """``default`` (decodes and prefill chunks mixed in every step; preempt the latest admitted) or
    ``deepinfer`` (DeepInfer's: all-prefill or all-decode steps, a prefill attempt every 70 decode
    steps while the cache is at most 0.9 full, whole-prompt FIFO admission with one chunked
    prompt at a time, preempt the longest output and stop a structured request; DSpark drafts
    only after decode steps, so the first decode after a prefill verifies none):
    :mod:`~deepinfer.engine.scheduler_deepinfer`."""
    seed_scope: str = "request"
    """Who shares a seed drawn for ``SamplingParams`` without one: ``request`` (each request
    draws its own, so repeated prompts sample independently) or ``sampling_params`` (DeepInfer:
    every request made from one ``SamplingParams`` object shares one seed, so repeated prompts
    sample identically; this changes pass@k-style numbers)."""
    use_tqdm: bool = True
    """Show a progress bar in generate()."""
    batch_invariant: bool = False
    """Make each request's logits bitwise independent of the rest of the batch."""
    async_scheduling: Optional[bool] = None
    """Schedule and launch decode step N+1 before collecting step N, so the host prepares a
    step while the device runs the one before (its input tokens are filled in on the device).
    DSpark verify steps overlap too at a fixed verify length, where steps run as padded passes
    (on a GPU; on the CPU with ``cuda_graphs=true``): drafts and start positions are read on
    the device.
    Steps with grammars, confidence-scheduled verify lengths, or near a request's
    ``max_tokens`` / ``max_model_len`` are collected before the next is scheduled. None: on for
    CUDA devices."""
    bounded_replay: BoundedReplayConfig = field(default_factory=BoundedReplayConfig)
    """SWA bounded replay of long prompts in the YOCO consumer layers."""
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    """Grammar compilation for structured outputs."""

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_tokens"):
            value = getattr(self, key)
            _require(value >= 1, f"engine.{key}", value, "must be >= 1")
        _require(self.prefill_chunk_tokens <= self.max_num_batched_tokens, "engine.prefill_chunk_tokens",
                 self.prefill_chunk_tokens,
                 f"must be <= engine.max_num_batched_tokens ({self.max_num_batched_tokens})")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "engine.num_kv_blocks",
                 self.num_kv_blocks, "must be null (sized automatically) or >= 1")
        _require(0 < self.gpu_memory_utilization <= 1, "engine.gpu_memory_utilization", self.gpu_memory_utilization,
                 "must lie in (0, 1]")
        _require(self.scheduler in SCHEDULERS, "engine.scheduler", self.scheduler, f"use one of {list(SCHEDULERS)}")
        _require(self.seed_scope in SEED_SCOPES, "engine.seed_scope", self.seed_scope,
                 f"use one of {list(SEED_SCOPES)}")


@dataclass
class BenchConfig:
    """One engine point of task=bench: ``batch`` requests of ``prompt_tokens`` random tokens, each
    generating ``output_tokens`` (the decoding policy from ``decoding``), drawn with ``seed``."""

    batch: int = 1
    prompt_tokens: int = 512
    output_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("batch", "prompt_tokens", "output_tokens"):
            _require(getattr(self, key) >= 1, f"bench.{key}", getattr(self, key), "must be >= 1")


TASKS = ("generate", "parity", "bench")
"""What ``python -m deepinfer task=...`` can run."""


@dataclass
class AppConfig:
    """Everything one run needs: the composed ``configs/config.yaml`` as typed objects."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model (``model=<preset>``)."""
    backend: BackendConfig = field(default_factory=BackendConfig)
    """The HAL backend (``backend=<name>``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Rank layout (``parallel=<preset>``)."""
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    """Default sampling and DSpark (``decoding=<preset>``)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine sizes and switches (``engine=<preset>``)."""
    task: str = "generate"
    """What ``python -m deepinfer`` does: ``generate`` (prompts to text), ``parity`` (the op
    parity grid and a greedy generation on two backends, :mod:`deepinfer.tasks.parity`) or
    ``bench`` (one engine point, :mod:`deepinfer.tasks.bench`; sweeps are Hydra multiruns)."""
    prompt: Optional[str] = None
    """One prompt to generate from."""
    prompts_file: Optional[str] = None
    """A text file with one prompt per line."""
    output_file: Optional[str] = None
    """File the results are written to; None prints them."""
    backend_a: str = "reference"
    """task=parity: the backend taken as the expectation."""
    backend_b: Optional[str] = None
    """task=parity: the backend compared with ``backend_a``."""
    batch_invariant_a: bool = False
    """task=parity: run ``backend_a``'s batch-invariant table."""
    batch_invariant_b: bool = False
    """task=parity: run ``backend_b``'s batch-invariant table."""
    execution_a: str = "native"
    """task=parity: ``native`` or ``emulate`` (the backend's CPU emulation, e.g. ascend950's)."""
    execution_b: str = "native"
    """task=parity: as ``execution_a``, for ``backend_b``."""
    ops: list[str] = field(default_factory=list)
    """task=parity: the ops compared (empty: every op)."""
    sizes: list[str] = field(default_factory=list)
    """task=parity: the case sizes run (``tiny``, ``real``; empty: both)."""
    generate_tokens: int = 32
    """task=parity: greedy tokens a prompt of the end-to-end comparison (0 skips it)."""
    output_dir: Optional[str] = None
    """Where task=parity writes ``parity.csv`` and ``parity.png`` (default
    ``outputs/parity_<a>_vs_<b>``) and task=bench appends to ``bench.csv`` (default ``outputs/bench``)."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """task=bench: the engine point measured."""
    study: Any = None
    """An experiment script's own settings (:mod:`deepinfer.study`): its dataclass, selected by
    ``configs/experiment/<name>.yaml``; None outside a study."""

    def __post_init__(self) -> None:
        _require(self.prompt is None or self.prompts_file is None, "prompts_file", self.prompts_file,
                 "give prompt or prompts_file, not both")
        if self.task not in TASKS:
            raise ConfigError(f"task={self.task!r} is not available yet; tasks: {list(TASKS)}")
        for key in ("execution_a", "execution_b"):
            _require(getattr(self, key) in ("native", "emulate"), key, getattr(self, key), "use native or emulate")
        _require(self.generate_tokens >= 0, "generate_tokens", self.generate_tokens, "must be >= 0 (0 skips it)")
        _require(set(self.sizes) <= {"tiny", "real"}, "sizes", self.sizes, "list case sizes among tiny, real")


def to_app_config(cfg: DictConfig) -> AppConfig:
    """The typed, validated form of a composed config; the only place a ``DictConfig`` becomes
    an :class:`AppConfig`."""
    app = OmegaConf.to_object(cfg)
    if not isinstance(app, AppConfig):
        raise ConfigError(f"expected a config composed on the AppConfig schema, got {type(app).__name__}; "
                          "compose it with deepinfer.config.compose.compose()")
    return app
