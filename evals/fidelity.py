"""Fidelity against the fp16 cache on the same model: the fp16 engine generates greedily (EOS ignored, so
every generation has the full length); every configuration then replays those tokens by teacher forcing
and we record, per generated token, whether its own greedy choice agreed (top-1 agreement) and the
log-probability it gave the fp16 token (NLL). Both compare whole distributions step by step, so they tell
small differences apart with far fewer samples than task accuracy."""
from __future__ import annotations

from diffkv_serve.engine import SamplingParams
from evals.memory import memory_fraction
from evals.runner import Request, run_requests
from evals.stats import mean, paired_diff

FIDELITY_INSTRUCTION = ("Solve the following problem. Explain every step of your reasoning in detail, check the "
                        "result, and then explain the mathematical ideas it uses.\n\n")


def fidelity_prompts(model, problems) -> list[list[int]]:
    return [model.chat_ids(FIDELITY_INSTRUCTION + p.question) for p in problems]


def reference_generations(engine, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    return [o.token_ids for o in run_requests(engine, [Request(p, sp) for p in prompts], "fp16 reference")]


def teacher_forced_requests(prompts: list[list[int]], refs: list[list[int]],
                            kv_compression: dict | None = None) -> list[Request]:
    return [Request(p, SamplingParams(temperature=0, max_tokens=len(r), ignore_eos=True, teacher_tokens=r,
                                      logprobs=True), kv_compression) for p, r in zip(prompts, refs)]


def score_fidelity(cache, head_dim: int, refs: list[list[int]], outs: list, desc: str) -> dict:
    """Per-generation agreement and NLL of one configuration along the reference tokens, and its memory."""
    per_gen, hi, lo, pr = [], 0, 0, 0
    for o, r in zip(outs, refs):
        if o.token_ids != r or len(o.teacher_agree) != len(r) or len(o.logprobs) != len(r):
            raise RuntimeError(f"{desc}: teacher forcing did not replay the reference ({len(o.token_ids)} tokens)")
        per_gen.append({"agree": sum(o.teacher_agree) / len(r), "nll": -sum(o.logprobs) / len(r)})
        u = o.kv_usage
        hi, lo, pr = hi + u["tokens_high"], lo + u["tokens_low"], pr + u["tokens_pruned"]
    total = hi + lo + pr
    return {
        "n_generations": len(refs), "gen_tokens": len(refs[0]) if refs else 0,
        "top1_agreement": mean([g["agree"] for g in per_gen]),
        "nll": mean([g["nll"] for g in per_gen]),
        "memory_fraction": memory_fraction(cache, head_dim, hi, lo, pr),
        "token_fractions": {"high": hi / total, "low": lo / total, "pruned": pr / total},
        "per_generation": per_gen,
    }


def compare_to_fp16(result: dict, fp16: dict) -> dict:
    """NLL increase and agreement drop vs fp16 with paired 95% intervals over generations."""
    a, b = fp16["per_generation"], result["per_generation"]
    nll = paired_diff([g["nll"] for g in a], [g["nll"] for g in b])
    agree = paired_diff([g["agree"] for g in a], [g["agree"] for g in b])
    return {"nll_increase": nll["mean"], "nll_increase_ci": [nll["ci_low"], nll["ci_high"]],
            "agreement_change": agree["mean"], "agreement_change_ci": [agree["ci_low"], agree["ci_high"]]}
