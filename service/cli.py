"""`diffkv` command line: generate (one prompt) and chat (interactive), on the embedded model by default."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or random:<preset> (default: embedded SmolLM2)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-mode", default="fp16", choices=["fp16", "int8", "int4", "diffkv"])
    p.add_argument("--alpha-high", type=float, default=None, help="diffkv: high-precision threshold")
    p.add_argument("--alpha-low", type=float, default=None, help="diffkv: low-precision threshold")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _build_engine(args):
    from engine import EngineConfig
    from engine.llm_engine import LLMEngine

    cache = {"kv_mode": args.kv_mode}
    cache.update({k: v for k, v in (("alpha_high", args.alpha_high), ("alpha_low", args.alpha_low)) if v is not None})
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                       cache=cache)
    return LLMEngine(cfg)


def _sampling(args):
    from engine import SamplingParams

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
    from engine.errors import InvalidRequestError

    engine = _build_engine(args)
    try:
        ids = _prompt_ids(engine, args.prompt, args.raw)
        out = _run(engine, ids, _sampling(args), None if args.json else sys.stdout)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        kv = out.kv_usage or {}
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "prompt_tokens": len(out.prompt_token_ids),
                          "kv": {**{k: kv.get(k, 0) for k in ("bytes_used", "bytes_fp16", "pages_used", "tokens_high",
                                                              "tokens_low", "tokens_pruned")},
                                 "pages_total": engine.mm.num_pages,
                                 "mm_seconds": engine.runner.kv.mm_seconds()}}))
    else:
        print()
    return 0


def cmd_chat(args) -> int:
    from engine.errors import InvalidRequestError

    engine = _build_engine(args)
    history: list[dict] = []
    print("Chat with the model (empty line or Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            break
        if not text:
            break
        try:
            out = _run(engine, _prompt_ids(engine, text, False, history), _sampling(args), sys.stdout)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        print()
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": out.text}]
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffkv", description="DiffKV Serve: LLM serving with a compressed KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, kv)")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat in the terminal")
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
