"""SFIConfig: every knob of Slow-Fast Inference in one frozen dataclass.

Each field `x` has a CLI name `--sfi-x` (underscores become dashes); validation
errors name the option in that form so a user can fix the command line directly.
Per-request overrides (custom_params["sfi"]) go through `SFIConfig.from_dict` /
`replace`, which reject unknown keys. The key "enabled" is not a field: the caller
strips it before calling `from_dict`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Mapping


METHODS = ("sfi", "streaming", "snapkv", "quest")


class SFIConfigError(ValueError):
    """An invalid SFI option; the message names the option in CLI form."""


def cli_name(field_name: str) -> str:
    """`min_gap` -> `--sfi-min-gap`."""
    return "--sfi-" + field_name.replace("_", "-")


def parse_layers(text: str) -> tuple[int, ...]:
    """"0,1" -> (0, 1); "" or "none" -> (). Duplicates are removed, order is sorted."""
    text = text.strip()
    if text == "" or text.lower() == "none":
        return ()
    out = []
    for piece in text.split(","):
        piece = piece.strip()
        try:
            out.append(int(piece))
        except ValueError:
            raise SFIConfigError(
                f"{cli_name('dense_layers')} must be a comma-separated list of layer "
                f"indices (or 'none'), got {text!r}") from None
    return tuple(sorted(set(out)))


FAST_PATHS = ("triton", "triton-pool", "flashinfer")
KERNEL_FAST_PATHS = ("triton", "triton-pool")  # kernels.fast_decode (and its log-sum-exp)
DENSE_BACKENDS = ("auto", "triton", "flashinfer")
REFRESH_MODES = ("boundary", "interval", "adaptive")


@dataclass(frozen=True)
class SFIConfig:
    # sparse memory shape (per KV head): S sinks + W window + K selected
    sinks: int = 4
    window: int = 256
    budget: int = 2048
    # trigger policy (see boundary.TriggerPolicy)
    min_gap: int = 16
    cooldown: int = 2
    max_interval: int = 96
    refresh: str = "boundary"            # "boundary" | "interval" (ablation) | "adaptive"
    # refresh "adaptive": boundaries, plus a slow step when the fast step's log-sum-exp over
    # the sparse memory (mean over the q heads of a few middle layers) falls this many nats
    # below its value at the first fast step after the last refresh (boundary.TriggerPolicy)
    adaptive_threshold: float = 0.5
    boundaries: str = "default"          # spec string, see boundary.parse_boundary_spec
    # layers that always run dense attention
    dense_layers: tuple[int, ...] = (0, 1)
    # last prompt query rows used for the bootstrap selection at the end of prefill
    bootstrap_rows: int = 8
    # selector (see selector.py; names follow docs/method.md)
    fusion: str = "arithmetic"           # "arithmetic" | "geometric"
    alpha: float = 0.5
    key_norm_gamma: float = 0.5
    w_l2: float = 1.0
    w_pos: float = 0.7
    pos_power: float = 1.8
    pos_tail: float = 0.4
    pos_beta: float = -math.log(0.6) / 0.9
    lambda_max_single: float = 0.35
    lambda_max_multi: float = 0.25
    nms_radius: int = 16
    nms_strength: float = 1.0
    excl_temperature: float = 2.0
    excl_strength: float = 0.85
    # neighbourhood max-pooling of the final score (selector.pool_neighbours); 0 = off.
    # Default 3 with soft-NMS off (use_nms): measured, see docs/method.md
    pool_radius: int = 3
    # "sfi", or a baseline run by the same backend at the same token budget (S + W + K):
    # "streaming" (StreamingLLM: sinks + a sliding window of W + K), "snapkv" (select K once
    # at the end of prefill from the observation rows, never refresh), "quest" (every step,
    # per layer and KV head: the K/page_size pages with the highest query-aware upper bound
    # from per-page min/max keys, plus sinks and window)
    method: str = "sfi"
    page_size: int = 16
    # the per-step top-up of SFI's fast steps: also attend to the topup_pages pages of
    # page_size tokens (inside [topup_lo, window start), holding no held position) with the
    # highest query-aware bound, Quest's, from the page's per-channel min/max keys; 0 = off.
    # On the Triton fast paths in the decode graphs (sfi_sglang.method.topup): docs/method.md.
    # Under SGLang's --page-size equal to page_size the min/max are kept per pool page as
    # the KV grows (topup.PageSummaries) and the scores read them, not the keys
    topup_pages: int = 0
    # the top-up's pages are chosen at every topup_every-th sparse layer (the first of each
    # group) and reused by the group's other layers, less the pages a layer holds: 1 = each layer
    topup_every: int = 1
    # the Selector keeps whole pages of this many tokens (aligned to position 0, each scored
    # by the log-sum-exp of its positions' scores; K // selection_page pages), as a fast
    # path reading pool pages would; 1 = single tokens. The torch reference and the Triton
    # fast paths (a head's pages at the candidates' edges may hold fewer than K positions:
    # the packed kernel skips the rest, kernels.fast_decode's `holes`)
    selection_page: int = 1
    # ablation switches
    use_prior: bool = True
    use_nms: bool = False                # the spec's soft-NMS: off by default (docs/method.md)
    use_exclusivity: bool = True
    # fast-step kernel on CUDA (server-wide): "triton" (kernels.fast_decode over packed
    # sinks + selected and the window in place), "triton-pool" (the same kernel reading the
    # sinks and the selected positions in place from SGLang's pool, through req_to_token:
    # no packed copy per request slot) or "flashinfer" (FlashInfer's paged decode over the
    # same positions in place, page size 1, KV heads folded into the batch, in the decode
    # graphs; needs flashinfer). Default by measurement (bench/NOTES.md sections 14, 32, 41
    # and 47): "triton-pool" gives the packed path's tokens, a KV pool of 98.5-99.3% of
    # dense's instead of 85-97% (more sequences at the largest batch), for batch-1 steps 2-6%
    # slower at 16K-32K.
    # The CPU always runs the torch reference.
    fast_path: str = "triton-pool"
    # the dense attention backend SFI wraps (server-wide): it runs prefill, the dense layers
    # and SFI-off rows. "auto": SGLang's triton on CUDA, torch_native on the CPU engine;
    # "triton"; "flashinfer" (CUDA, needs flashinfer)
    dense_backend: str = "auto"
    # a decode step runs the dense backend alone, at every layer and row, while its batch
    # holds fewer than this many tokens beyond its rows' sparse memories: sum over the rows
    # of max(0, context - sinks - window - budget). Where SFI cannot win (short contexts,
    # small batches) it then costs what dense costs; a row's first sparse step after dense
    # ones is slow (a fresh selection). Server-wide; 0 = never (SFI at every step)
    dense_below: int = 0
    # the most rows of a decode step that run a slow step (server-wide); a row beyond them
    # runs that step fast and its slow step at the next. The slow pass's score buffers and
    # the Selector's work are sized by it rather than by the request slots: on the kernel
    # path a score row is H_q x context-length float32 (5.2 MB for Qwen3-4B at 40K).
    # 0 = every row may be slow in the same step (score rows for every request slot)
    max_slow_rows: int = 8
    # how many requests hold a sparse memory at once (server-wide): its memory rows. A row
    # is what scales with the budget (the selected positions, 2.4 MB for Qwen3-4B at 2048;
    # on the "triton" path also the packed K/V, 302 MB). A request takes a row when its
    # context first passes sinks + window + budget (before, a fast step reads its whole
    # context anyway) and gives it back when SGLang frees its slot; one that finds none free
    # runs dense until one is. 0 = a row for every request slot, and sfi_sglang's launchers
    # then default --max-running-requests to 64; with rows, SGLang's own default holds.
    # "auto" (the default): a row for every request the KV pool can hold past that length
    # (rows_for), so none waits; 0 on CUDA's packed "triton" path, where a row also holds
    # K/V (on_device)
    memory_rows: int | str = "auto"  # str: "auto" only

    def __post_init__(self):
        # Normalise convenient input forms (CLI strings, JSON lists, ints for floats).
        layers = self.dense_layers
        if isinstance(layers, str):
            layers = parse_layers(layers)
        elif isinstance(layers, (list, tuple)):
            layers = tuple(layers)
        object.__setattr__(self, "dense_layers", layers)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, f.name, float(v))
        self.validate()

    def sparse_layers(self, num_layers: int) -> list[int]:
        """The layers of a num_layers-layer model that run SFI (all but dense_layers)."""
        return [lid for lid in range(num_layers) if lid not in self.dense_layers]

    @property
    def topup_lo(self) -> int:
        """Where the top-up's pages start: the first page boundary at or past the sinks (so
        that they are SGLang's pool pages under --page-size page_size)."""
        return -(-self.sinks // self.page_size) * self.page_size

    def topup_layers(self, num_layers: int) -> list[int]:
        """The sparse layers that choose top-up pages: the first of each group of topup_every."""
        return self.sparse_layers(num_layers)[::self.topup_every] if self.topup_pages else []

    def memory_tokens(self) -> int:
        """S + W + K: the positions a fast step reads per layer and KV head, at most."""
        return self.sinks + self.window + self.budget

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        def bad(name, what):
            raise SFIConfigError(f"{cli_name(name)} must be {what}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("window", "budget", "min_gap", "max_interval", "bootstrap_rows", "topup_every",
                     "selection_page"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                bad(name, "a positive integer")
        for name in ("sinks", "cooldown", "nms_radius", "pool_radius", "topup_pages", "dense_below",
                     "max_slow_rows", "memory_rows"):
            v = getattr(self, name)
            if name == "memory_rows" and v == "auto":
                continue
            if not is_int(v) or v < 0:
                bad(name, "a non-negative integer" + (" or auto" if name == "memory_rows" else ""))
        if self.max_interval < self.min_gap:
            raise SFIConfigError(
                f"{cli_name('max_interval')} ({self.max_interval}) must be >= "
                f"{cli_name('min_gap')} ({self.min_gap})")
        if not isinstance(self.dense_layers, tuple) or not all(
                is_int(x) and x >= 0 for x in self.dense_layers):
            bad("dense_layers", "a list of non-negative layer indices")
        if self.refresh not in REFRESH_MODES:
            bad("refresh", "'boundary', 'interval' or 'adaptive'")
        if self.method not in METHODS:
            bad("method", "one of " + ", ".join(METHODS))
        if not is_int(self.page_size) or self.page_size < 1:
            bad("page_size", "a positive integer")
        if self.topup_pages and self.page_size & (self.page_size - 1):  # the top-up kernel's tiles
            bad("page_size", f"a power of two with {cli_name('topup_pages')}")
        if self.fusion not in ("arithmetic", "geometric"):
            bad("fusion", "'arithmetic' or 'geometric'")
        if not isinstance(self.boundaries, str):
            bad("boundaries", "a string")
        from sfi_sglang.method.boundary import parse_boundary_spec
        try:
            parse_boundary_spec(self.boundaries)
        except ValueError as e:
            raise SFIConfigError(f"{cli_name('boundaries')}: {e}") from None
        for name in ("key_norm_gamma", "w_l2", "w_pos", "pos_beta"):
            if not is_num(getattr(self, name)):
                bad(name, "a finite number")
        for name in ("alpha", "pos_tail", "nms_strength", "excl_strength"):
            v = getattr(self, name)
            if not is_num(v) or v < 0:
                bad(name, "a finite number >= 0")
        for name in ("pos_power", "excl_temperature", "adaptive_threshold"):
            v = getattr(self, name)
            if not is_num(v) or v <= 0:
                bad(name, "a finite number > 0")
        for name in ("lambda_max_single", "lambda_max_multi"):
            v = getattr(self, name)
            if not is_num(v) or not 0 <= v <= 1:
                bad(name, "a number in [0, 1]")
        if self.fast_path not in FAST_PATHS:
            bad("fast_path", "'triton', 'triton-pool' or 'flashinfer'")
        if self.dense_backend not in DENSE_BACKENDS:
            bad("dense_backend", "'auto', 'triton' or 'flashinfer'")
        for name in ("use_prior", "use_nms", "use_exclusivity"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")

    def check_server(self, tp_size: int, kv_cache_dtype: str = "auto") -> None:
        """What SFI needs of SGLang's own server options, checked where a launch knows them
        (the CLI, Engine, and the backend in each scheduler): one tensor-parallel rank for
        the adaptive trigger; a KV cache in the model's dtype or in fp8 (SFI's kernels read
        fp8 entries at unit scales, SGLang's default without --quantization-param-path; the
        backend refuses a model with KV scales), not fp4."""
        if self.refresh == "adaptive" and tp_size > 1:
            raise SFIConfigError(f"{cli_name('refresh')} adaptive needs --tp-size 1 (each rank holds "
                                 "only its heads and would decide its refreshes alone)")
        if str(kv_cache_dtype).startswith("fp4"):
            raise SFIConfigError(f"--kv-cache-dtype {kv_cache_dtype} is not supported with SFI yet: "
                                 "use auto or fp8_e4m3, or serve dense with --disable-sfi")

    def on_device(self, cuda: bool) -> "SFIConfig":
        """The options as a server on this device runs them: --sfi-memory-rows auto sizes
        the rows by the KV pool, except on CUDA's packed `triton` fast path, where a row
        also holds K/V (~0.3 GB for Qwen3-4B at the default budget, about what the tokens
        it stands for take in the pool, which would halve it): there auto is 0, a row per
        request slot. Every launcher and scheduler resolves it here, so all agree."""
        if self.memory_rows == "auto" and cuda and self.fast_path == "triton":
            return self.replace(memory_rows=0)
        return self

    def rows_for(self, pool_tokens: int, slots: int) -> int:
        """The memory rows a server makes (0: one per request slot): --sfi-memory-rows, or
        with auto one for every request a KV pool of `pool_tokens` can hold past S + W + K
        (a request takes one only there, so none waits); at most `slots` either way."""
        if self.memory_rows != "auto":
            return min(self.memory_rows, int(slots))
        return max(1, min(int(slots), int(pool_tokens) // self.memory_tokens() + 1))

    # ---------------------------------------------------------------- construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def _check_keys(cls, keys) -> None:
        valid = cls.field_names()
        for k in keys:
            if k not in valid:
                raise SFIConfigError(
                    f"unknown SFI option {k!r}; valid options: {', '.join(valid)}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: "SFIConfig | None" = None) -> "SFIConfig":
        """Build from a dict of field values (on top of `base`, default: the defaults).

        Unknown keys (including "enabled", which the caller must strip) raise
        SFIConfigError naming the key and listing the valid ones.
        """
        if not isinstance(d, Mapping):
            raise SFIConfigError(f"SFI options must be a dict, got {type(d).__name__}")
        cls._check_keys(d.keys())
        if base is None:
            return cls(**d)
        return dataclasses.replace(base, **d)

    def replace(self, **kw) -> "SFIConfig":
        """A validated copy with some fields changed."""
        return type(self).from_dict(kw, base=self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- launch-time transport
# SGLang spawns its scheduler processes from the launcher; they inherit the environment.
# The launcher (sfi_sglang.Engine / `sfi-sglang serve`) writes the server-wide config here
# once, as JSON, and the `sfi` attention backend reads it in each scheduler process.
CONFIG_ENV = "SFI_SGLANG_CONFIG"


def export_config(cfg: SFIConfig) -> None:
    import json
    import os

    os.environ[CONFIG_ENV] = json.dumps(cfg.to_dict())


def server_config() -> SFIConfig:
    import json
    import os

    text = os.environ.get(CONFIG_ENV)
    return SFIConfig.from_dict(json.loads(text)) if text else SFIConfig()


def add_cli_args(parser) -> None:
    """One `--sfi-<field>` option per SFIConfig field (values validated by SFIConfig)."""
    group = parser.add_argument_group("SFI (Slow-Fast Inference)")
    for f in fields(SFIConfig):
        default = getattr(SFIConfig, f.name)
        kind = type(default)
        if kind is bool:
            group.add_argument(cli_name(f.name), dest=f"sfi_{f.name}", type=_parse_bool,
                               default=None, metavar="{true,false}", help=f"default: {default}")
        else:
            shown = ",".join(map(str, default)) if kind is tuple else default
            parse, form = _CLI_TYPES.get(f.name, (str if kind is tuple else kind, None))
            group.add_argument(cli_name(f.name), dest=f"sfi_{f.name}", type=parse, default=None,
                               help=f"default: {shown}" + (f" ({form})" if form else ""))
    group.add_argument("--disable-sfi", action="store_true",
                       help="serve with the platform's dense attention backend (plain SGLang)")


def config_from_args(args) -> SFIConfig:
    """SFIConfig from parsed `--sfi-*` options (unset ones keep their defaults)."""
    given = {f.name: getattr(args, f"sfi_{f.name}") for f in fields(SFIConfig)}
    return SFIConfig.from_dict({k: v for k, v in given.items() if v is not None})


def _parse_rows(text: str):
    return "auto" if text.strip().lower() == "auto" else int(text)


_CLI_TYPES = {"memory_rows": (_parse_rows, "a number, or auto")}  # field: (parser, what it takes)


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)
