"""How precise the query must be against low-bit keys: each layer's decode attention on a prompt's own queries,
keys and values, with K/V quantized as the cache stores them and the query as the CUDA decode kernel's integer
dot takes it -- integers at each head's own scale (mma_cuda.query_levels): amax / 32767, the 16-bit q it uses
against 8-bit keys (two integer mma chains), and amax / 127, the 8-bit q it uses against 4- and 2-bit keys (one
chain), whose zero points' term takes that rounded q too ("int8/zq": that term on q as given instead, so that q's
rounding meets key - zero point rather than the key) -- beside fp16 q.

Per layer: the last --queries prompt positions attend causally to every earlier token. Errors are relative L2 norms
of the attention output against float64 with unquantized K/V ("total"), and of each q's output against the fp16 q's
on the same quantized K/V ("q alone"), whose ratio to fp16's total says how much the query's rounding adds to
what the cache's quantization already costs. With --rotation hadamard the model's queries and keys are rotated as
the engine serves quantized caches (engine/kv_rotation.py); with --key-centering served, keys are centered as
the engine centers them for a quantized cache (engine/key_centering.py: the model's calibrated centers, else its
k_proj bias, else none).

Usage:  python benchmarks/q_precision.py [--model qwen2.5-coder-1.5b] [--tokens 1024]   (CPU is enough; the
        default model is the embedded SmolLM2)
Smoke:  python benchmarks/q_precision.py --smoke
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402

from diffkv_serve.engine import key_centering, kv_rotation  # noqa: E402
from diffkv_serve.engine.config import CacheConfig  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.engine.model import CausalLM  # noqa: E402
from diffkv_serve.engine.model_settings import load_model_settings  # noqa: E402
from diffkv_serve.kernels.prefill_attention import prefill_attention  # noqa: E402
from diffkv_serve.kernels.quant import dequantize_ref, quantize_ref  # noqa: E402

# q as the kernel rounds it: None = fp16, else (levels, whether the keys' zero-point term takes q as given)
Q_FORMATS = {"fp16": None, "int16": (32767, False), "int8": (127, False), "int8/zq": (127, True)}
KV_FORMATS = {"K4V4": (4, 4), "K4V2": (4, 2), "K2V2": (2, 2), "K8V8": (8, 8), "K8V4": (8, 4), "K8V2": (8, 2)}
PROMPT = ("Solve each problem, showing every step of the arithmetic.\n" + "".join(
    f"Problem {i}: A warehouse holds {17 * i + 3} crates of {i + 2} boxes each; {5 * i + 1} crates leave each day "
    f"and {2 * i + 7} arrive. How many boxes are there after {i % 5 + 2} days?\n"
    f"def step_{i}(crates, boxes):\n    return crates * boxes - {i} * (crates // {i % 3 + 2})\n" for i in range(1, 400)))


def parse_args(argv=None):
    return run_flags(__doc__, ["K4V4", "K4V2"], "off").parse_args(argv)


def run_flags(doc: str, kv: list[str], centering: str) -> argparse.ArgumentParser:
    """The flags of a run over a model's own attention (this script's, p_precision.py's), with their defaults."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    add_engine_flags(ap, only=("model",))
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--queries", type=int, default=32, help="last prompt positions that attend, per layer")
    ap.add_argument("--kv", nargs="+", default=kv, choices=list(KV_FORMATS))
    ap.add_argument("--rotation", nargs="+", default=["off", "hadamard"], choices=["off", "hadamard"])
    ap.add_argument("--key-centering", choices=["off", "served"], default=centering,
                    help="served: the centers the engine installs for a quantized cache")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="the embedded model, 96 tokens, 8 queries")
    return ap


def round_q(q: torch.Tensor, levels: int | None) -> torch.Tensor:
    """q [..., D] float64 as the kernel multiplies it: fp16 (levels None), else integers at this row's scale
    amax / levels."""
    if levels is None:
        return q.half().double()
    amax = q.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    return torch.round(q / scale) * scale


def quantized(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] through the cache's min-max quantization per (token, head) and back, float64, with the scales and
    zero points [...] (1 and 0 at 16 bits)."""
    if bits == 16:
        return x.half().double(), torch.ones(x.shape[:-1], dtype=torch.float64), torch.zeros(x.shape[:-1],
                                                                                             dtype=torch.float64)
    packed, scale, zero = quantize_ref(x.float(), bits)
    return dequantize_ref(packed, scale, zero, bits, x.shape[-1]).double(), scale.double(), zero.double()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, extra=None) -> torch.Tensor:
    """q [P, Hq, D] at prompt positions pos, k/v [N, Hkv, D] -> [P, Hq, D], causal, GQA, float64. extra: [Hq, P, N]
    added to q.k before the scale (a kernel's own term)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [N, Hq, D]
    logits = torch.einsum("phd,nhd->hpn", q, kk)
    if extra is not None:
        logits = logits + extra
    logits = logits * q.shape[-1] ** -0.5
    logits = logits.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hpn,nhd->phd", logits.softmax(-1), vv)


def zero_term_on_given_q(q: torch.Tensor, qr: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[Hq, P, N]: what a logit gains where the keys' zero-point term takes q as given and the codes' term the
    rounded qr, z * sum (q - qr), over the keys' zero points [N, Hkv]."""
    group = q.shape[1] // zeros.shape[1]
    return torch.einsum("ph,nh->hpn", (q - qr).sum(-1), zeros.repeat_interleave(group, 1))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| per (position, head), averaged."""
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).mean())


class Capture:
    """An attention backend for one plain forward: keeps each layer's q (last positions), k and v, and returns the
    engine's causal prompt attention (kernels/prefill_attention.py) so the forward runs as the model's own."""

    def __init__(self, queries: int):
        self.queries = queries
        self.layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.layers.append((q[-self.queries:].double(), k.double(), v.double()))
        return prefill_attention(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device))


def served_centers(ckpt, model: CausalLM) -> torch.Tensor | None:
    """The key centers the engine installs for a quantized cache (key_centering 'auto', an int4 cache)."""
    settings = load_model_settings(ckpt.name)
    mode = key_centering.resolve_mode(CacheConfig(kv_mode="int4"), ckpt.arch, settings)
    return key_centering.centers_for(mode, settings, ckpt.arch, model, (0, ckpt.arch.num_kv_heads))


@torch.no_grad()
def capture(ckpt, ids: torch.Tensor, rotation: str, queries: int, centering: str = "off") -> Capture:
    model = CausalLM(ckpt.arch, ids.numel())
    model.load_weights(ckpt.weights)
    if centering == "served":  # before the rotation: centers are measured in the model's own basis
        key_centering.install(model, served_centers(ckpt, model))
    kv_rotation.install(model.eval(), rotation)
    cap = Capture(queries)
    model(ids, torch.arange(ids.numel()), cap)
    return cap


def prompt_of(args):
    """(checkpoint, prompt token ids, the positions that attend) for a run's --model / --tokens / --queries (--smoke:
    the embedded model, 96 tokens, 8 queries); prints the run's header line."""
    if args.smoke:
        args.model, args.tokens, args.queries = None, 96, 8
    if not 1 <= args.queries <= args.tokens:
        raise ValueError(f"--queries {args.queries}: needs 1 <= queries <= --tokens ({args.tokens})")
    ckpt = load_checkpoint(args.model)
    ids = torch.tensor(ckpt.tokenizer.encode(PROMPT)[: args.tokens], dtype=torch.long)
    if ids.numel() < args.tokens:
        raise ValueError(f"--tokens {args.tokens}: the prompt has {ids.numel()} tokens with this tokenizer")
    print(f"{ckpt.name}, {args.tokens} prompt tokens, last {args.queries} attend, key centering {args.key_centering}; "
          "relative L2 of the attention output, mean over layers (max)")
    return ckpt, ids, torch.arange(args.tokens - args.queries, args.tokens)


def configs(args, ckpt, ids):
    """(rotation, kv, key bits, value bits, the captured layers' q / k / v) for every --rotation x --kv of a run."""
    for rotation in args.rotation:
        cap = capture(ckpt, ids, rotation, args.queries, args.key_centering)
        for kv in args.kv:
            yield (rotation, kv, *KV_FORMATS[kv], cap.layers)


def error_row(what: str, rotation: str, kv: str, name: str, errs: list[tuple[float, float, float]]) -> dict:
    """One table row from each layer's (error vs exact, error vs the baseline, baseline's error vs exact), where
    `what` ('q', 'p') is the rounded operand; printed as it is made."""
    total, alone = [e[0] for e in errs], [e[1] for e in errs]
    share = [e[1] / max(e[2], 1e-30) for e in errs]
    row = {"rotation": rotation, "kv": kv, what: name, "total_mean": sum(total) / len(total), "total_max": max(total),
           f"{what}_alone_mean": sum(alone) / len(alone), f"{what}_alone_max": max(alone),
           "share_mean": sum(share) / len(share), "share_max": max(share)}
    print(f"{rotation:>9} {kv:>5} {name:>8} {row['total_mean']:8.2e} ({row['total_max']:7.1e}) "
          f"{row[what + '_alone_mean']:8.2e} ({row[what + '_alone_max']:7.1e}) {row['share_mean']:10.3f} "
          f"({row['share_max']:6.3f})", flush=True)
    return row


def error_header(what: str) -> None:
    print(f"{'rotation':>9} {'kv':>5} {what:>8} {'total':>17} {what + ' alone':>17} {what + ' alone / fp16 total':>21}")


def record(name: str, ckpt, args, argv, rows: list) -> None:
    """The run's JSON (with --out): benchmark, model, the command line, the flags and the rows."""
    cmd = f"python benchmarks/{name}.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"benchmark": name, "model": ckpt.name, "device": "cpu", "torch": torch.__version__, "command": cmd,
              "config": vars(args), "rows": rows}
    if args.out:
        write_result(result, name, "cpu", args.out, args.smoke)


def run(args, argv, name: str, what: str, outputs) -> int:
    """A run over every --rotation x --kv: outputs(q, k, v, key bits, value bits, pos) gives each layer's exact
    attention output, the baseline's and {format: output} for the formats of `what` (the rounded operand); prints
    and records a row per (rotation, kv, format)."""
    ckpt, ids, pos = prompt_of(args)
    rows = []
    error_header(what)
    for rotation, kv, kb, vb, layers in configs(args, ckpt, ids):
        per_layer = {}
        for q, k, v in layers:
            exact, base, got = outputs(q, k, v, kb, vb, pos)
            for fmt, out in got.items():
                per_layer.setdefault(fmt, []).append((rel(out, exact), rel(out, base), rel(base, exact)))
        rows += [error_row(what, rotation, kv, fmt, errs) for fmt, errs in per_layer.items()]
    record(name, ckpt, args, argv, rows)
    return 0


def q_outputs(q, k, v, kb: int, vb: int, pos):
    """Exact attention, fp16 q on the quantized cache (the baseline), and q as each of Q_FORMATS rounds it."""
    (kq, _, zeros), (vq, _, _) = quantized(k, kb), quantized(v, vb)
    got = {}
    for name, fmt in Q_FORMATS.items():
        qr = round_q(q, fmt and fmt[0])
        got[name] = attend(qr, kq, vq, pos, zero_term_on_given_q(q, qr, zeros) if fmt and fmt[1] else None)
    return attend(q, k, v, pos), got["fp16"], got


def main(argv=None) -> int:
    return run(parse_args(argv), argv, "q_precision", "q", q_outputs)


if __name__ == "__main__":
    sys.exit(main())
