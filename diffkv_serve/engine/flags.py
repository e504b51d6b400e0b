"""The engine's command-line flags, defined once for `diffkv generate / chat / serve`, the evals and the
benchmarks: `add_engine_flags` adds them to a parser, `engine_settings` reads back the ones given (as EngineConfig
fields) and `engine_config_from_args` builds the EngineConfig.

Every flag defaults to None, meaning "not given": the field then stays unset, so EngineConfig's default applies,
the model's calibrated value fills a DiffKV threshold or precision (engine.model_settings), and under `diffkv
serve` the value of --config stands. A script with a default of its own (an eval defaults to the diffkv cache)
passes it in `defaults`; --help shows each default.
"""
from __future__ import annotations

import argparse
import copy
import re
from typing import Any, Iterable, Mapping, Optional

from diffkv_serve.engine.config import KV_MODE_CHOICES, CacheConfig, EngineConfig, SchedulerConfig

THREADS_HELP = "torch CPU threads (default on CPU: the cores not busy with other processes, 1 to 4)"
DTYPES = ("auto", "float32", "float16", "bfloat16")

# flag name -> (where the value goes in EngineConfig, argparse keywords). Where: a top-level field, or
# "cache.<field>" / "scheduler.<field>"; None: not an EngineConfig field (threads: the process's torch threads).
_FLAGS: dict[str, tuple[Optional[str], dict[str, Any]]] = {
    "model": ("model", {"help": "HF folder, .gguf file or random:<preset> (default: the embedded SmolLM2)"}),
    "device": ("device", {"help": "auto | cpu | cuda | cuda:N"}),
    "dtype": ("dtype", {"choices": DTYPES, "help": "weights and unquantized cache values; auto: bfloat16 on "
                                                   "CUDA, float32 on CPU"}),
    "max_model_len": ("max_model_len", {"type": int, "help": "context length (default: the model's)"}),
    "kv_mode": ("cache.kv_mode", {"choices": KV_MODE_CHOICES,
                                  "help": "KV cache: fp16 (uncompressed, in --dtype), int8, int4, fp8 (e4m3), "
                                          "diffkv, or auto (the model's measured best mode, else fp16)"}),
    "alpha_high": ("cache.alpha_high", {"type": float, "help": "diffkv: high-precision threshold (default: the "
                                                                "model's calibrated value)"}),
    "alpha_low": ("cache.alpha_low", {"type": float, "help": "diffkv: low-precision threshold (default: the "
                                                              "model's calibrated value)"}),
    "high": ("cache.high", {"help": "diffkv: precision of significant tokens, e.g. K8V4 (default: the model's)"}),
    "low": ("cache.low", {"help": "diffkv: precision of moderately significant tokens, e.g. K4V2 (default: the "
                                  "model's)"}),
    "kv_cache_memory_gb": ("cache.kv_cache_memory_gb", {"type": float, "help": "bytes of the KV page pool (default: "
                                                                               "0.5 GiB on CPU, "
                                                                               "gpu_memory_utilization on CUDA)"}),
    "max_num_seqs": ("scheduler.max_num_seqs", {"type": int, "help": "largest batch of running requests"}),
    "prefill_min_prompts": ("scheduler.prefill_min_prompts", {"type": int, "help": "prompts a prompt step waits "
                                                                                 "for while sequences run; 1: none"}),
    "prefill_max_delay_steps": ("scheduler.prefill_max_delay_steps", {"type": int, "help": "decode steps a "
                                                                                           "fitting prompt waits at "
                                                                                           "most"}),
    "prefill_watermark": ("scheduler.prefill_watermark", {"type": float, "help": "share of the pool prompts may "
                                                                                 "not take while sequences run"}),
    "tensor_parallel_size": ("tensor_parallel_size", {"type": int, "help": "ranks (Ray worker actors) the model "
                                                                           "is split over"}),
    "engine_seed": ("seed", {"type": int, "help": "the engine's torch seed (random weights, unseeded sampling)"}),
    "enforce_eager": ("enforce_eager", {"action": "store_const", "const": True,
                                        "help": "CUDA: run every step eagerly instead of replaying CUDA graphs"}),
    "max_graph_batch_size": ("max_graph_batch_size", {"type": int, "help": "largest decode batch captured in a "
                                                                           "CUDA graph"}),
    "max_prefill_graph_tokens": ("max_prefill_graph_tokens", {"type": int, "help": "largest prompt step (tokens) "
                                                                                   "replayed from a CUDA graph; 0: "
                                                                                   "none"}),
    "threads": (None, {"type": int, "help": THREADS_HELP}),
}
ENGINE_FLAGS: tuple[str, ...] = tuple(_FLAGS)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, also for options without help text; options whose default is
    None or off say nothing (their help says what None means)."""

    _NO_HELP = "\0"  # stands in for a missing help text: argparse prints no help line for an empty one

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        d = action.default
        return bool(action.option_strings) and not (d is None or d is False or d == [] or d is argparse.SUPPRESS)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = copy.copy(action)
            action.help = self._NO_HELP
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").replace(self._NO_HELP, "")
        if "%(default)" in text or not self._shows_default(action):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _field_default(where: str) -> Any:
    section, _, name = where.rpartition(".")
    model = {"": EngineConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}[section]
    return model.model_fields[name].get_default(call_default_factory=True)


def add_engine_flags(parser: argparse.ArgumentParser, only: Optional[Iterable[str]] = None,
                     exclude: Iterable[str] = (), defaults: Optional[Mapping[str, Any]] = None) -> None:
    """Add the engine flags (all, or those named in `only`, less `exclude`) as one argument group. `defaults`
    (flag name -> value) gives a script's own defaults; other flags default to None (unset)."""
    names = list(only) if only is not None else list(ENGINE_FLAGS)
    unknown = sorted(set(names) - set(_FLAGS) | set(exclude) - set(_FLAGS) | set(defaults or ()) - set(_FLAGS))
    if unknown:
        raise ValueError(f"add_engine_flags: unknown engine flags {unknown}; known: {list(ENGINE_FLAGS)}")
    group = parser.add_argument_group("engine")
    for name in names:
        if name in exclude:
            continue
        where, kwargs = _FLAGS[name]
        kwargs = dict(kwargs)
        default = (defaults or {}).get(name)
        if default is not None:  # the script's default replaces the field's
            kwargs["help"] = re.sub(r" \(default: [^)]*\)$", "", kwargs["help"]) + " (default: %(default)s)"
        elif where is not None and "(default:" not in kwargs["help"]:
            # shown, not applied: an unset flag leaves the field to EngineConfig (or the model's settings)
            shown = _field_default(where)
            if shown not in (None, False):
                kwargs["help"] += f" (default: {shown})"
        group.add_argument("--" + name.replace("_", "-"), default=default, **kwargs)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given (not None), as nested EngineConfig fields: {"device": "cpu",
    "cache": {"kv_mode": "diffkv"}}. Fields not given are absent, so they stay unset in the EngineConfig."""
    out: dict[str, Any] = {}
    for name, (where, _) in _FLAGS.items():
        value = getattr(args, name, None)
        if where is None or value is None:
            continue
        section, _, field = where.rpartition(".")
        (out.setdefault(section, {}) if section else out)[field] = value
    return out


def engine_config_from_args(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """EngineConfig from the given engine flags; `fields` (EngineConfig fields a command fixes) come first and
    the flags override them, section by section."""
    settings = engine_settings(args)
    merged = dict(fields)
    for key, value in settings.items():
        if isinstance(value, dict):
            base = merged.get(key) or {}
            if isinstance(base, (CacheConfig, SchedulerConfig)):
                base = base.model_dump(exclude_unset=True)
            merged[key] = {**base, **value}
        else:
            merged[key] = value
    return EngineConfig(**merged)


def apply_threads(args: argparse.Namespace) -> Optional[int]:
    """Set torch's CPU threads from --threads (engine.threads' default where it is not given)."""
    from diffkv_serve.engine.threads import set_threads

    return set_threads(getattr(args, "threads", None), getattr(args, "device", None) or "auto")


def run_command(parser: argparse.ArgumentParser, argv: Optional[list[str]] = None,
                interrupt_code: Optional[int] = None) -> int:
    """A command line's main: parse, run the chosen command; a missing file or a bad value is one `error:` line
    and exit 2. interrupt_code: Ctrl-C returns it (the shell's 130) instead of raising."""
    import logging
    import sys

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if interrupt_code is None:
            raise
        print(file=sys.stderr)
        return interrupt_code
