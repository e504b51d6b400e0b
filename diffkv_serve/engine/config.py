"""Typed engine configuration: one place defines each name and its default."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

KVMode = Literal["fp16", "int8", "int4", "fp8", "diffkv"]
KV_MODES: tuple[str, ...] = get_args(KVMode)  # the cache modes an engine runs
# "auto": the mode the model's settings file names (the fastest that measured within a point of fp16), else fp16;
# engine.model_settings.resolve_kv_mode replaces it once the engine knows its model and device.
KVModeSetting = Literal["auto", "fp16", "int8", "int4", "fp8", "diffkv"]
KV_MODE_CHOICES: tuple[str, ...] = get_args(KVModeSetting)  # the --kv-mode choices of every command
ExecutorKind = Literal["auto", "local", "ray"]
# Which tokens DiffKV may prune, by the phase they came from: the prompt's (the prefill's classification and
# later decode steps), the generated ones (decode steps), or both. A token outside it is kept, at low precision
# at least, where it would have been pruned. An ablation of where pruning costs accuracy.
PrunePhase = Literal["both", "prompt", "generation"]
PRUNE_PHASES: tuple[str, ...] = PrunePhase.__args__
# Largest decode batch a CUDA graph is captured for (vLLM's default capture limit too): every bucket up to it costs
# graph memory, and past a few hundred rows a decode step is no longer launch-bound, so eager steps lose little.
GRAPH_BATCH_CAP = 512


def parse_precision(text: str, field: str = "precision") -> tuple[int, int]:
    """'K8V4' -> (8, 4); bits from {16, 8, 4, 2}."""
    m = re.fullmatch(r"[Kk](\d+)[Vv](\d+)", text.strip())
    if not m or int(m[1]) not in (16, 8, 4, 2) or int(m[2]) not in (16, 8, 4, 2):
        raise ValueError(f"{field}={text!r}: write a precision as K<bits>V<bits> with bits in 16, 8, 4, 2 (e.g. K8V4)")
    return int(m[1]), int(m[2])


def parse_settings(spec: str, keys: dict[str, type], what: str = "spec") -> tuple[str, dict]:
    """'diffkv:alpha_low=0.06,window=32' -> ('diffkv', {'alpha_low': 0.06, 'window': 32}), each value converted
    by keys[name] (the command-line form of a cache configuration in the benchmarks and evals); a ValueError
    names the bad part, `what` the option it came from."""
    head, _, rest = spec.partition(":")
    settings = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in keys or not eq:
            raise ValueError(f"{what} {spec!r}: expected key=value with key in {sorted(keys)}, got {item!r}")
        try:
            settings[key] = keys[key](value)
        except ValueError:
            kind = "number" if keys[key] in (int, float) else keys[key].__name__
            raise ValueError(f"{what} {spec!r}: {key}={value!r} is not a {kind}") from None
    return head, settings


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_mode: KVModeSetting = Field(
        "auto", description="fp16 (uncompressed, in the model's dtype: bfloat16 on CUDA, float32 on CPU unless "
                            "dtype says otherwise), int8 (K8V8), int4 (K4V4), fp8 (e4m3 keys and values with a "
                            "scale per token and KV head), diffkv, or 'auto': the mode the model's settings file "
                            "names (the fastest one measured on a GPU within a point of fp16's task accuracy), "
                            "fp16 on the CPU or for a model without one; resolved when the engine loads the model")
    block_size: int = Field(16, ge=1, description="tokens of a full-precision page; page bytes follow from it")
    num_pages: Optional[int] = Field(None, ge=1, description="fixed pool size; overrides kv_cache_memory_gb")
    kv_cache_memory_gb: Optional[float] = Field(
        None, gt=0, description="bytes for the page pool; default: 0.5 GiB on CPU, gpu_memory_utilization on CUDA")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="CUDA: fraction of the GPU's memory the "
                                                                          "engine may use (the pool gets what the "
                                                                          "model leaves)")
    # diffkv only (paper defaults, Llama-3 calibration, until `python3 -m evals.cli calibrate` writes per-model values)
    high: str = Field("K8V4", description="precision of significant tokens")
    low: str = Field("K4V2", description="precision of moderately significant tokens")
    alpha_high: float = Field(1.0, ge=0, description="token kept high if significance >= alpha_high / position")
    alpha_low: float = Field(0.02, ge=0, description="token kept low if significance >= alpha_low / position")
    # A low token's score and position serve one purpose: choosing which low token to prune. Where nothing can be
    # pruned (alpha_low 0), low pages leave both rows out and cost what a uniform page of their precision does.
    track_low: Union[bool, Literal["auto"]] = Field(
        "auto", description="diffkv: low pages carry each token's significance score and position (8 bytes a token "
                            "and KV head), which pruning low tokens needs; without them no request may set "
                            "kv_compression.alpha_low above 0. 'auto': exactly when the policy is thresholds with "
                            "alpha_low > 0")
    window: int = Field(64, ge=1, description="most recent tokens always kept at high precision")
    significance_queries: int = Field(64, ge=1, description="last prompt queries whose attention scores tokens")
    prune_phase: PrunePhase = Field(
        "both", description="policy=thresholds: which tokens may be pruned: 'prompt' (prompt tokens only: generated "
                            "ones are never pruned), 'generation' (generated tokens only: the whole prompt is kept, "
                            "at low precision at least) or 'both'; per request kv_compression.prune_phase")
    record_pruning: bool = Field(
        False, description="debug / evaluation (local executor): each finished request's kv_usage carries "
                           "'token_classes', int8 [layers, KV heads, tokens]: each position high (2), low (1) or "
                           "pruned (0) at its finish (one device read per request; async scheduling 'auto' is off)")
    # Evaluation baseline: "budget" keeps the `budget` fraction of each KV head's tokens (window + most
    # significant) at precision `high` and prunes the rest (H2O/SnapKV-style equal per-head budget).
    policy: Literal["thresholds", "budget"] = Field("thresholds", description="diffkv: alpha thresholds or budget")
    budget: float = Field(0.5, gt=0, le=1, description="policy=budget: fraction of tokens each KV head keeps")
    enable_prefix_caching: Union[bool, Literal["auto"]] = Field(
        "auto", description="share the KV of prompt prefixes between requests (docs/PREFIX_CACHING.md); 'auto': "
                            "on for fp16 / int8 / int4 / fp8 (no measurable cost when prompts share nothing), off "
                            "for diffkv (sharing pins each prompt's full blocks at the high precision, which costs "
                            "memory when nothing is shared)")
    # The rule that lets diffkv share prefix-cache pages (docs/PREFIX_CACHING.md): a prompt's full blocks of
    # the high precision's page size are what a prefix cache may share, so they are kept high, never demoted,
    # pruned or moved, whether or not they came from the cache; the same rule without the cache gives the
    # same tokens.
    pin_prompt_blocks: Union[bool, Literal["auto"]] = Field(
        "auto", description="diffkv: keep each prompt's full blocks (its first floor(n / T) * T tokens, T the high "
                            "precision's tokens per page) at high precision, never demoted or pruned, and let "
                            "its prefill attend over them as stored; 'auto': on exactly when prefix caching is "
                            "(which needs it)")
    # Per-layer budgets (XKV-style; `python3 -m evals.cli calibrate --per-layer` measures them): layer l classifies with
    # alpha_high * s[l] and alpha_low * s[l], per-request alphas included. Unset: the model's settings file;
    # None: one global pair of thresholds.
    layer_alpha_scale: Optional[list[float]] = Field(
        None, description="policy=thresholds: per-layer multipliers of both alphas (one per layer, > 0)")

    # Key centering (engine.key_centering): a static per-(layer, KV head) vector subtracted from post-RoPE keys,
    # exact under softmax, so quantized keys spend their range on information instead of a constant offset.
    key_centering: Literal["auto", "calibrated", "bias", "off"] = Field(
        "auto", description="subtract a per-(layer, KV head) key mean before quantizing: 'calibrated' (the model's "
                            "settings file), 'bias' (the rotated k_proj bias, no calibration), 'off', or 'auto' "
                            "(calibrated, else bias, else off; off for the fp16 cache)")
    # KV rotation (engine.kv_rotation): keys, queries and values multiplied by one orthogonal (randomized
    # Hadamard) matrix, exact under attention, so a channel outlier no longer sets a token's low-bit scale.
    kv_rotation: Literal["auto", "hadamard", "off"] = Field(
        "auto", description="rotate keys, queries and values by a randomized Hadamard matrix before the cache "
                            "(values folded into v_proj / o_proj at load, keys one small matmul per layer): "
                            "'hadamard', 'off', or 'auto' (on for every quantized cache, off for fp16)")

    @model_validator(mode="after")
    def _check(self) -> "CacheConfig":
        parse_precision(self.high, "high")
        parse_precision(self.low, "low")
        if self.prune_phase != "both" and self.policy != "thresholds":
            raise ValueError(f"prune_phase={self.prune_phase!r} needs policy 'thresholds' (the budget policy prunes "
                             "by its budget alone)")
        if self.alpha_low > self.alpha_high:
            raise ValueError(f"alpha_low={self.alpha_low} must not exceed alpha_high={self.alpha_high}")
        if self.kv_mode == "diffkv" and self.policy == "budget" and (self.enable_prefix_caching is True
                                                                      or self.pin_prompt_blocks is True):
            raise ValueError("enable_prefix_caching / pin_prompt_blocks need policy 'thresholds' in diffkv mode: "
                             "the budget policy keeps a fixed share of tokens, so it cannot pin a prompt's blocks")
        if self.kv_mode == "diffkv" and self.enable_prefix_caching is True and self.pin_prompt_blocks is False:
            raise ValueError("pin_prompt_blocks=False with enable_prefix_caching=True: diffkv shares prompt "
                             "blocks only where they are pinned high (docs/PREFIX_CACHING.md)")
        if "alpha_low" in self.model_fields_set:  # unset, it is the model settings file's (checked when resolved)
            self._check_track_low()
        for i, s in enumerate(self.layer_alpha_scale or ()):
            if not 0 < s < float("inf"):
                raise ValueError(f"layer_alpha_scale[{i}]={s}: per-layer multipliers must be finite and > 0")
        return self

    @property
    def resolved_mode(self) -> KVMode:
        """kv_mode, which must be resolved: what the pool, the policy and every report use."""
        if self.kv_mode == "auto":
            raise ValueError("cache.kv_mode 'auto' is not resolved yet: the engine resolves it for its model "
                             "(engine.model_settings.resolve_kv_mode); pass an explicit kv_mode here")
        return self.kv_mode

    def check_num_layers(self, num_layers: int) -> None:
        """layer_alpha_scale, when given, has one multiplier per layer of the model."""
        n = len(self.layer_alpha_scale) if self.layer_alpha_scale is not None else num_layers
        if n != num_layers:
            raise ValueError(f"layer_alpha_scale has {n} multipliers; the model has {num_layers} layers")

    def prefix_caching(self) -> bool:
        """Whether enable_prefix_caching (resolved for 'auto') turns the prefix cache on."""
        if self.enable_prefix_caching == "auto":
            return self.resolved_mode != "diffkv"
        return self.enable_prefix_caching

    def pins_prompt_blocks(self) -> bool:
        """Whether diffkv keeps each prompt's full blocks high and unmoved (pin_prompt_blocks, 'auto' resolved)."""
        if self.resolved_mode != "diffkv" or self.policy != "thresholds":
            return False
        if self.pin_prompt_blocks == "auto":
            return self.prefix_caching()
        return self.pin_prompt_blocks

    def precisions(self) -> tuple[tuple[int, int], Optional[tuple[int, int]]]:
        """(high, low) page precisions of this mode; low is None for single-precision modes."""
        mode = self.resolved_mode
        if mode == "diffkv":
            return parse_precision(self.high, "high"), parse_precision(self.low, "low")
        return {"fp16": (16, 16), "int8": (8, 8), "int4": (4, 4), "fp8": (8, 8)}[mode], None

    def tracks_tokens(self) -> bool:
        """Whether pages carry each token's score and position: diffkv's policy ranks and moves tokens; a
        single-precision cache keeps them in order and its pages leave both rows out."""
        return self.resolved_mode == "diffkv"

    def tracks_low_tokens(self) -> bool:
        """Whether the low section's pages carry score and position rows (track_low, 'auto' resolved): only
        pruning a low token reads them, and only a threshold policy with alpha_low > 0 prunes low tokens."""
        if self.resolved_mode != "diffkv":
            return False
        if self.track_low == "auto":
            return self.policy != "thresholds" or self.alpha_low > 0
        self._check_track_low()
        return self.track_low

    def _check_track_low(self) -> None:
        if self.track_low is False and self.policy == "thresholds" and self.alpha_low > 0:
            raise ValueError(f"track_low=False with alpha_low={self.alpha_low}: pruning low tokens needs their "
                             "scores (set alpha_low 0, or track_low true or 'auto')")

    @property
    def float8(self) -> bool:
        """Whether the 8-bit pages hold e4m3 codes (kv_mode fp8) rather than integer codes."""
        return self.resolved_mode == "fp8"

    def describe(self) -> dict[str, Any]:
        """What decides how tokens are stored and dropped, resolved ('auto' prefix caching included), as JSON
        for logs and APIs; the diffkv fields only in diffkv mode, the thresholds only under policy thresholds.
        Pool sizing is left out: it says how many tokens fit, not how each is kept."""
        high, low = self.precisions()
        code = "-e4m3" if self.float8 else ""  # PageFormat.name's spelling of e4m3 pages
        out: dict[str, Any] = {"kv_mode": self.resolved_mode, "high": f"K{high[0]}V{high[1]}{code}",
                               "low": f"K{low[0]}V{low[1]}" if low else None,
                               "prefix_caching": self.prefix_caching()}
        if self.kv_mode == "diffkv":
            out.update(policy=self.policy, window=self.window)
            if self.pins_prompt_blocks():  # only when on: runs recorded before the rule still match
                out["pin_prompt_blocks"] = True
            if not self.tracks_low_tokens():  # likewise: a cache whose low pages have no score or position rows
                out["track_low"] = False
            if self.policy == "thresholds":
                out.update(alpha_high=self.alpha_high, alpha_low=self.alpha_low,
                           layer_alpha_scale=self.layer_alpha_scale, prune_phase=self.prune_phase)
            else:
                out["budget"] = self.budget
        return out


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_num_seqs: int = Field(64, ge=1, description="largest batch of running requests")
    max_num_batched_tokens: int = Field(8192, ge=1, description="most prompt tokens one prefill step computes")
    # Prompt page reservation of DiffKV prompts (engine.kv.footprint): "worst_case" reserves every prompt
    # all-high; "learned" reserves what prompts of that length kept so far and retries a prompt that overflowed
    # the pool under the worst case. Single-precision modes keep exactly their worst case, so both rules agree there.
    reservation: Literal["worst_case", "learned"] = Field(
        "worst_case", description="diffkv prompt page reservation: the all-high worst case, or the learned footprint")
    footprint_quantile: float = Field(0.95, gt=0, le=1, description="learned: quantile of the kept-page ratios")
    footprint_margin: float = Field(0.1, ge=0, description="learned: the estimate is scaled by 1 + margin")
    footprint_min_samples: int = Field(
        8, ge=1, description="learned: prefills a length bucket needs before its estimate replaces the worst case")
    footprint_max_samples: int = Field(256, ge=1, description="learned: most recent samples kept per bucket")
    # Prompt-step batching (engine.scheduler): a prompt step stops every running sequence's decoding for one
    # forward whose fixed cost (host work, reading the step in flight, a sync) dwarfs a few short prompts'
    # compute. Once the pool is full, pages come back one finished sequence at a time, so without waiting each
    # prompt step admits one or two prompts.
    prefill_min_prompts: int = Field(
        8, ge=1, description="while sequences run, a prompt step waits until this many waiting prompts fit (or all "
                             "that wait, as many as the free slots and the token budget take, or one per this many "
                             "running sequences, whichever is fewest), for at most prefill_max_delay_steps decode "
                             "steps; 1: admit whatever fits at once")
    prefill_max_delay_steps: int = Field(
        16, ge=0, description="decode steps a prompt that fits may wait for prefill_min_prompts to fit with it")
    # Admission headroom: a prompt admitted into the last free pages is often preempted a few steps later, when
    # the running sequences grow, and recomputed.
    prefill_watermark: float = Field(
        0.01, ge=0, lt=1, description="share of the pool's pages a prompt may not take while sequences run (headroom "
                                     "for their growth, against preempting what was just admitted)")
    # Async scheduling (engine.llm_engine): decode step N+1 is scheduled and launched before step N's tokens are
    # read, so the host's per-step work (scheduling, inputs, outputs) overlaps the GPU instead of idling it.
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto", description="launch the next decode step before processing this one's tokens: 'auto' (on for the "
                            "local executor on CUDA), 'on' (local executor, any device), 'off'")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = Field(None, description="HF folder, .gguf file, 'random:<preset>' or None (embedded)")
    device: str = Field("auto", description="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N'")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights and unquantized cache values; auto: bfloat16 on CUDA, float32 on CPU")
    max_model_len: Optional[int] = Field(None, ge=1, description="default: the model's context length")
    seed: int = Field(0, description="torch seed of the engine (random weights, requests without a seed)")
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly instead of replaying CUDA graphs")
    max_graph_batch_size: int = Field(
        256, ge=1, le=GRAPH_BATCH_CAP,
        description="largest decode batch captured in a CUDA graph (also at most scheduler.max_num_seqs); larger "
                    "batches run eagerly. The graphs' memory is taken from the KV pool's budget")
    max_prefill_graph_tokens: int = Field(
        4096, ge=0,
        description="largest prompt step (in tokens, also at most scheduler.max_num_batched_tokens) replayed from a "
                    "CUDA graph, for single-precision caches on one rank; 0: every prompt step eager. Short prompt "
                    "steps wait on the host's kernel launches otherwise. The graphs' memory is taken from the KV "
                    "pool's budget")
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the model is split over (heads by whole KV groups, MLP columns); at most the "
                             "model's KV head count")
    distributed_executor: ExecutorKind = Field(
        "auto", description="'local' (in-process, one rank), 'ray' (one Ray actor per rank, in a placement "
                            "group), or 'auto': local for tensor_parallel_size 1, ray otherwise")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="the paged KV cache and its compression")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="batching and page reservation")

    @model_validator(mode="after")
    def _check_device(self) -> "EngineConfig":
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.scheduler.async_scheduling == "on" and self.executor_kind != "local":
            raise ValueError("scheduler.async_scheduling='on' needs the local executor (tensor_parallel_size 1): "
                             "Ray ranks run their steps synchronously")
        if self.cache.record_pruning and self.executor_kind != "local":
            raise ValueError("cache.record_pruning needs the local executor (tensor_parallel_size 1): the token "
                             "classes are read from this process's pages")
        if self.cache.record_pruning and self.scheduler.async_scheduling == "on":
            raise ValueError("cache.record_pruning needs scheduler.async_scheduling 'off' or 'auto': a step launched "
                             "past a request's stop would change what is recorded")
        if (self.cache.kv_mode == "diffkv" and self.cache.prefix_caching()
                and self.scheduler.reservation == "learned"):
            raise ValueError("cache.enable_prefix_caching with scheduler.reservation 'learned' is not supported "
                             "for diffkv: a prompt that overflows the pool would leave its new cached blocks "
                             "without pages; use reservation 'worst_case'")
        if self.distributed_executor == "local" and self.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs distributed_executor 'ray' "
                             "or 'auto'; the 'local' executor runs a single rank")
        if self.executor_kind == "ray" and self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} names one GPU, but with distributed_executor 'ray' (or "
                             f"tensor_parallel_size > 1) Ray assigns each rank its GPU: use 'cuda' or 'auto'")
        return self

    @property
    def executor_kind(self) -> Literal["local", "ray"]:
        """The executor 'auto' resolves to."""
        if self.distributed_executor != "auto":
            return self.distributed_executor
        return "local" if self.tensor_parallel_size == 1 else "ray"
