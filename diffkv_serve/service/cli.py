"""`diffkv` command line: serve (the OpenAI API on Ray Serve), drain, generate (one prompt) and chat
(interactive), on the embedded model by default. Accuracy evaluation and calibration run from the checkout
(`python3 -m evals.cli eval | calibrate`): the serving package imports no evaluation code."""
from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Optional

from diffkv_serve.engine.flags import (HelpFormatter, add_engine_flags, apply_threads, engine_config_from_args,
                                       run_command)
from diffkv_serve.service.config import API_KEY_ENV
from diffkv_serve.service.serve_command import cmd_drain, cmd_serve


PACKAGE = "diffkv-serve"


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version(PACKAGE)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _build_engine(args):
    from diffkv_serve.engine.llm_engine import LLMEngine

    apply_threads(args)
    return LLMEngine(engine_config_from_args(args))


def _sampling(args):
    from diffkv_serve.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _prompt_ids(engine, text: str, raw: bool, history: Optional[list] = None) -> list[int]:
    tok = engine.tokenizer
    if raw or not getattr(tok, "chat_template", None):
        return tok.encode(text)
    messages = (history or []) + [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def _run(engine, ids: list[int], sampling, stream) -> "object":
    engine.add_request("cli", ids, sampling)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream is not None and out.delta_text:
                stream.write(out.delta_text)
                stream.flush()
            if out.finished:
                final = out
    return final


def cmd_generate(args) -> int:
    from diffkv_serve.engine.errors import InvalidRequestError

    engine = _build_engine(args)
    try:
        ids = _prompt_ids(engine, args.prompt, args.raw)
        out = _run(engine, ids, _sampling(args), None if args.json else sys.stdout)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        kv = out.kv_usage or {}
        counts = ("bytes_used", "bytes_fp16", "bytes_uncompressed", "pages_used", "pages_shared", "tokens_high",
                  "tokens_low", "tokens_pruned")
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "prompt_tokens": len(out.prompt_token_ids),
                          "kv": {"kv_mode": engine.config.cache.resolved_mode, "cache_dtype": engine.cache_dtype,
                                 **{k: kv.get(k, 0) for k in counts}, "pages_total": engine.mm.num_pages,
                                 "mm_seconds": engine.runner.kv.mm_seconds()}}))
    else:
        print()
    return 0


def cmd_chat(args) -> int:
    from diffkv_serve.engine.errors import InvalidRequestError

    engine = _build_engine(args)
    history: list[dict] = []
    print("Chat with the model (empty line, Ctrl-D or Ctrl-C to quit).", file=sys.stderr)
    while True:
        try:
            text = input("> ").strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, Ctrl-C at the prompt: a plain goodbye, no traceback
            print(file=sys.stderr)
            break
        if not text:
            break
        try:
            out = _run(engine, _prompt_ids(engine, text, False, history), _sampling(args), sys.stdout)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C mid-answer ends the chat as at the prompt
            print(file=sys.stderr)
            break
        print()
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": out.text}]
    return 0



def _service_default(field: str):
    """ServiceConfig's default of a field (serve's flags default to None: --config's value comes first)."""
    from diffkv_serve.service.config import ServiceConfig

    return ServiceConfig.model_fields[field].get_default(call_default_factory=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffkv", description="DiffKV Serve: LLM serving with a compressed KV cache",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add = functools.partial(sub.add_parser, formatter_class=HelpFormatter)
    g = add("generate", help="generate a completion for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, kv)")
    add_engine_flags(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = add("chat", help="interactive chat in the terminal")
    add_engine_flags(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    s = add("serve", help="serve the OpenAI-compatible API on Ray Serve (Ctrl-C stops)",
            description="Engine flags left out take --config's value, else EngineConfig's default (DiffKV "
                        "thresholds and precisions: the model's calibrated values).")
    s.add_argument("--config", default=None, help="YAML/JSON of ServiceConfig fields (or a Serve config file)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a Jinja chat template used instead of the model's (e.g. one that renders tools)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--num-replicas", type=int, default=None,
                   help=f"engine replicas (default: {_service_default('num_replicas')})")
    s.add_argument("--ttft-target", type=float, default=None,
                   help=f"admission control's TTFT target in seconds (default: "
                        f"{_service_default('admission').ttft_target_s})")
    s.add_argument("--no-admission", action="store_true", help="admit every request (no 429s)")
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (repeat it to accept several keys while "
                        f"rotating; {API_KEY_ENV}, comma-separated, adds keys without putting them on the command "
                        f"line)")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"largest request body; larger ones get 413 before they are parsed (default: "
                        f"{_service_default('limits').max_body_bytes})")
    s.add_argument("--drain-timeout", type=float, default=None,
                   help=f"seconds requests in flight get to finish on SIGTERM / Ctrl-C (default: "
                        f"{_service_default('drain_timeout_s')})")
    s.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    s.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray (default: detected)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus export port of the local Ray (on loopback when --host is)")
    add_engine_flags(s, exclude=("threads",))  # an engine replica's threads follow its Ray CPUs
    s.set_defaults(func=cmd_serve)
    d = add("drain", help="drain a running app before its cluster stops (a KubeRay preStop hook)",
            description="New requests get 503, requests in flight get the drain timeout to finish, the rest end "
                        "with 503 / an SSE error event; returns once every ingress replica has none left.")
    d.add_argument("--address", default="auto", help="the Ray cluster")
    d.add_argument("--app", default="diffkv", help="the Serve application")  # service.app.APP_NAME
    d.add_argument("--timeout", type=float, default=None,
                   help="seconds requests in flight get (default: the app's ServiceConfig.drain_timeout_s)")
    d.add_argument("--max-wait", type=float, default=300.0, help="give up waiting after this many seconds")
    d.add_argument("--cancel", action="store_true", help="withdraw a drain: the ingress replicas serve again")
    d.add_argument("--follow", action="store_true",
                   help="announce nothing: wait for a drain another process announces within --follow-s (a worker "
                        "pod's preStop: its engine replica keeps serving while the head drains)")
    d.add_argument("--follow-s", type=float, default=15.0)
    d.set_defaults(func=cmd_drain)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    # Ctrl-C while a model loads or a completion runs: the shell's code, no traceback
    return run_command(build_parser(), argv, interrupt_code=130)


if __name__ == "__main__":
    sys.exit(main())
