"""Owns the model, the KV memory manager and one device; turns a scheduled batch into sampled tokens."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from diffkv_serve.engine import key_centering, kv_rotation
from diffkv_serve.engine.attention import PagedAttention, StepMetadata
from diffkv_serve.engine.config import EngineConfig
from diffkv_serve.engine.devices import device_name
from diffkv_serve.engine.grammar import TokenMasks
from diffkv_serve.engine.graph_memory import (graph_batch_limit, graph_memory_estimate, kv_pool_bytes,
                                              prefill_graph_bytes)
from diffkv_serve.engine.host_copy import to_device
from diffkv_serve.engine.kv.layout import CacheShape, pages_for_bytes
from diffkv_serve.engine.kv.policy import CachedPrefix, KVCache, PrefillInfo
from diffkv_serve.engine.kv.request_settings import KVRequestSettings
from diffkv_serve.engine.kv.request_settings import resolve as resolve_kv_settings
from diffkv_serve.engine.logits_processors import TokenHistory
from diffkv_serve.engine.logprobs import PromptLogprobs, StepLogprobs, prompt_logprobs, step_logprobs
from diffkv_serve.engine.model import CausalLM
from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.engine.model_settings import load_model_settings
from diffkv_serve.engine.parallel import SINGLE, ParallelContext
from diffkv_serve.engine.profiling import cost_range, costed
from diffkv_serve.engine.sampler import sample, with_logprobs
from diffkv_serve.engine.sequence import Sequence

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    dev = torch.device(device_name(name))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class Batch:
    is_prefill: bool
    seqs: list[Sequence]
    # Set by a learned-reservation prefill (engine.kv.footprint): indices of sequences whose pages did not fit
    # (their tokens are placeholders; their pages stay held until the scheduler frees them), and the pages
    # each sequence kept: on the busiest rank (reservation) and summed over ranks (growth stats).
    overflowed: list[int] = field(default_factory=list)
    pages_kept: Optional[list[int]] = None
    pages_total: Optional[list[int]] = None
    # Rows a grammar restricts and their allowed tokens (engine.grammar), computed while the forward runs.
    token_masks: Optional[TokenMasks] = None


@dataclass
class InFlight:
    """A decode step launched by ModelRunner.launch whose tokens are still on their way to the host."""
    batch: Batch
    tokens: torch.Tensor  # host int64 [n]: filled by a non-blocking copy once `done` has passed
    logprobs: Optional[torch.Tensor]  # host float32 [n], or None
    done: Optional[torch.cuda.Event]  # None on CPU (the copies were synchronous)


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, weights: dict | None, max_model_len: int,
                 pc: ParallelContext = SINGLE, model_name: Optional[str] = None):
        self.config = config
        self.arch = arch
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        # Build directly on the device in the target dtype (an 8B model never exists in fp32).
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(arch, max_model_len, pc)
        finally:
            torch.set_default_dtype(prev)
        if weights is None:
            model.init_random(config.seed)
        else:
            model.load_weights(weights)
        self.model = model.eval()
        self.key_centering = self._center_keys(model_name, pc)
        kv_rotation.install(self.model, kv_rotation.resolve_mode(config.cache))
        self.graph_budget: Optional[int] = None  # set by _num_pages when it sizes the pool around the graphs
        shape = CacheShape(arch.num_layers, pc.num_kv_heads(arch), arch.head_dim,
                           config.scheduler.max_num_seqs, max_model_len, config.cache.block_size)
        self.kv = KVCache(config.cache, shape, self._num_pages(shape), self.dtype, self.device,
                          pc.num_heads(arch))
        self.mm = self.kv.mm
        # Sequences the driver resolved no settings for (a prompt_logits probe) run with the cache config's.
        self.default_kv_settings = resolve_kv_settings(None, config.cache)
        # DiffKV under learned reservation: prompts take their pages layer by layer, nothing reserved.
        self.learned = self.kv.diffkv and config.scheduler.reservation == "learned"
        self.attn = PagedAttention(self.kv, arch.head_dim ** -0.5)
        self.max_model_len = max_model_len
        # prompt tokens prefills computed: prefix-cache hits are read, not computed, except in graphed prompt steps
        self.num_prefill_tokens = 0
        # Async scheduling (LLMEngine): a decode step is launched before the previous step's tokens reach the host,
        # so its input ids come from the device: every sampled token is also written to its slot's row here.
        mode = config.scheduler.async_scheduling
        self.async_steps = mode == "on" or (mode == "auto" and self.device.type == "cuda"
                                            and config.executor_kind == "local" and not config.cache.record_pruning)
        self.token_table = None
        if self.async_steps:
            S = config.scheduler.max_num_seqs
            self.token_table = torch.zeros(self.mm.dummy_slot + 1, dtype=torch.int64, device=self.device)
            pin = self.device.type == "cuda"
            # Two sets: the step being launched copies into one while the previous step's is still to be read.
            self._host_tokens = [torch.zeros(S, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
            self._host_logprobs = [torch.zeros(S, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
            self._host_set = 0
        self._decode_slots: Optional[torch.Tensor] = None  # device slots of the last decode step's rows
        self._prompt_lp: dict[int, PromptLogprobs] = {}  # the current prefill's prompt logprobs, by row
        self._samples = True  # this rank samples the current step
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from diffkv_serve.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.attn, self._graph_batch(), max_model_len, self.token_table,
                                       self.graph_budget)
        self.prefill_graphs = None
        tokens = self._prefill_graph_tokens()
        if tokens > 0:
            from diffkv_serve.engine.prefill_graph import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(self.model, self.attn, tokens,
                                                min(config.scheduler.max_num_seqs, tokens), learned=self.learned)
        log.info("KV cache (%s): %d pages of %d bytes (%d high tokens each) on %s", config.cache.resolved_mode,
                 self.mm.num_pages, self.mm.page_bytes, self.mm.fmt_high.tokens, self.device)

    def _center_keys(self, model_name: Optional[str], pc: ParallelContext) -> dict:
        """Install the key centering the config resolves to (engine.key_centering); what stats() reports."""
        settings = load_model_settings(model_name) if model_name else None
        mode = key_centering.resolve_mode(self.config.cache, self.arch, settings)
        centers = key_centering.centers_for(mode, settings, self.arch, self.model, pc.kv_heads(self.arch))
        key_centering.install(self.model, centers)
        return key_centering.describe(mode, centers)

    def use_key_centers(self, centers: torch.Tensor) -> None:
        """Center keys on `centers` [L, Hk, D] (single rank) from now on: calibration measures centers and
        sweeps with them before any settings file holds them. Call before the first request."""
        centers = key_centering.check_centers(centers.tolist(), self.arch)
        key_centering.install(self.model, centers)
        self.key_centering = key_centering.describe("calibrated", centers)

    def _num_pages(self, shape: CacheShape) -> int:
        """Pages of the pool; under gpu_memory_utilization, sets graph_budget (the CUDA graphs' reserved bytes)."""
        cc = self.config.cache
        if cc.num_pages is not None:
            return cc.num_pages
        if cc.kv_cache_memory_gb is not None:
            nbytes = cc.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            # Blocks PyTorch caches but no tensor holds (an engine freed before this one) are free for the pool.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of a full batch of prefill tokens and logits, and for the CUDA graphs
            # (decode steps; short prompt steps).
            act = 64 * self.config.scheduler.max_num_batched_tokens * self.arch.hidden_size
            dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
            heads = (self.arch.group_size * shape.num_kv_heads, shape.num_kv_heads)  # this rank's
            graphs = 0 if self.config.enforce_eager else graph_memory_estimate(
                self.arch, self._graph_batch(), dtype_bytes, *heads)
            self.graph_budget = graphs
            graphs += prefill_graph_bytes(self.arch, self._prefill_graph_tokens(), dtype_bytes, *heads)
            nbytes = kv_pool_bytes(free, total, cc.gpu_memory_utilization, act, graphs)
        else:
            nbytes = 0.5 * 2**30
        return pages_for_bytes(shape, self.dtype, nbytes, cc.tracks_tokens())

    def _prefill_graph_tokens(self) -> int:
        """Largest prompt step a CUDA graph replays (0: none). Eager: a tensor-parallel forward (it all-reduces),
        and diffkv prompt steps that pin prompt blocks (prefix caching: cached rows read in data-dependent
        shapes) or that keep a budget."""
        cfg, cc = self.config, self.config.cache
        diffkv_eager = cc.tracks_tokens() and (cc.policy != "thresholds" or cc.pins_prompt_blocks())
        if self.device.type != "cuda" or cfg.enforce_eager or diffkv_eager or cfg.tensor_parallel_size > 1:
            return 0
        return min(cfg.max_prefill_graph_tokens, cfg.scheduler.max_num_batched_tokens)

    def _graph_batch(self) -> int:
        return graph_batch_limit(self.config.max_graph_batch_size, self.config.scheduler.max_num_seqs)

    def _to_device(self, rows: list) -> list[torch.Tensor]:
        """Several int lists / numpy arrays in one host-to-device copy (int64)."""
        host = torch.from_numpy(np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]))
        packed = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        return list(packed.split([len(r) for r in rows]))

    def _kv_settings(self, seq: Sequence) -> KVRequestSettings:
        return seq.kv_settings or self.default_kv_settings

    @torch.inference_mode()
    def execute(self, batch: Batch, keep_logits: bool = False,
                sample_tokens: bool = True) -> tuple[list[int], StepLogprobs | None]:
        """Run one step -> (tokens, log-probabilities if any row asked); with keep_logits the last positions'
        fp32 logits stay in self.last_logits. sample_tokens=False (tensor-parallel ranks other than 0) runs the
        forward and returns no tokens."""
        seqs = batch.seqs
        self._prompt_lp, self._samples = {}, sample_tokens  # only the sampling rank reports prompt logprobs
        if sample_tokens and batch.token_masks is None:  # the host fills them while the forward runs
            batch.token_masks = TokenMasks.start(seqs, self.arch.vocab_size)
        logits = self._prefill(seqs) if batch.is_prefill else self._decode(seqs)
        self.last_logits = logits if keep_logits else None
        if batch.is_prefill and self.learned:
            self._settle_prefill(batch)
        if batch.overflowed:  # sample the others only: a seeded generator draws nothing for a prompt redone later
            lost = set(batch.overflowed)
            keep = [i for i in range(len(seqs)) if i not in lost]
            self._prompt_lp = {j: self._prompt_lp[i] for j, i in enumerate(keep) if i in self._prompt_lp}
            masks = batch.token_masks.take(keep) if batch.token_masks is not None else None
            tokens, logprobs = ([], None) if not keep else self._sample(
                Batch(True, [seqs[i] for i in keep], token_masks=masks), logits[keep], sample_tokens)
            if not sample_tokens:
                return [], None
            return _scatter(tokens, keep, len(seqs), -1), (logprobs.take(keep, len(seqs)) if logprobs else None)
        return self._sample(batch, logits, sample_tokens)

    @torch.inference_mode()
    def launch(self, batch: Batch) -> InFlight:
        """Async scheduling: enqueue a decode step (inputs, graphs, sampling, the tokens' copy to the host) and
        return without waiting; collect() reads its tokens. Input ids come from token_table, so the previous
        step's tokens need not have reached the host. Not for prefills or teacher-forced rows (execute)."""
        seqs = batch.seqs
        logits = self._decode(seqs, snapshot=True)
        with cost_range("model"):
            out = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                         self._history(seqs, decode=True))
            tokens, logprobs = out.tokens, out.logprobs
            self._remember_tokens(seqs, tokens, decode=True)
        for s in seqs:
            s.num_cached += 1
        n, k = len(seqs), self._host_set
        self._host_set ^= 1
        tok_h = self._host_tokens[k][:n]
        tok_h.copy_(tokens, non_blocking=True)
        lp_h = None
        if logprobs is not None:
            lp_h = self._host_logprobs[k][:n]
            lp_h.copy_(logprobs, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return InFlight(batch, tok_h, lp_h, done)

    @costed("model")
    def collect(self, step: InFlight) -> tuple[list[int], StepLogprobs | None]:
        """Wait for a launched step's tokens (and chosen-token logprobs: rows asking for top-k logprobs are not
        launched ahead, LLMEngine runs them synchronously)."""
        if step.done is not None:
            step.done.synchronize()
        lp = StepLogprobs(step.logprobs.tolist()) if step.logprobs is not None else None
        return step.tokens.tolist(), lp

    def _history(self, seqs: list[Sequence], decode: bool) -> Optional[TokenHistory]:
        """What penalties and min_tokens read (None when no row uses them). A decode row has generated
        num_cached + 1 - prompt tokens (true before the host has the newest one under async scheduling, which is
        then this step's input id in token_table)."""
        if not any(s.params.penalizes or s.params.min_tokens for s in seqs):
            return None
        if decode:
            generated = [s.num_cached + 1 - len(s.prompt_token_ids) for s in seqs]
        else:
            generated = [len(s.output_token_ids) for s in seqs]
        last = None
        if decode and self.token_table is not None and any(s.params.penalizes for s in seqs):
            last = self.token_table[self._decode_slots]
        return TokenHistory([s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], generated, last)

    def _remember_tokens(self, seqs: list[Sequence], tokens: torch.Tensor, decode: bool) -> None:
        """Async scheduling: each row's sampled token into its slot's row of token_table."""
        if self.token_table is None:
            return
        slots = self._decode_slots if decode else to_device([s.slot for s in seqs], torch.int64, self.device)
        self.token_table[slots] = tokens

    @costed("memory")
    def _settle_prefill(self, batch: Batch) -> None:
        """Which prompts overflowed the pool and the pages each kept, in one device read."""
        info, mm = self.attn.meta.prefill, self.mm
        held = (mm.held_high[info.slots] + mm.held_low[info.slots]).sum((1, 2), dtype=torch.int64)
        flat = torch.cat([info.overflow.to(torch.int64), held]).tolist()
        n = len(batch.seqs)
        batch.overflowed = [i for i in range(n) if flat[i]]
        batch.pages_kept = batch.pages_total = flat[n:]

    @costed("model")
    def _sample(self, batch: Batch, logits: torch.Tensor,
                sample_tokens: bool) -> tuple[list[int], StepLogprobs | None]:
        seqs = batch.seqs
        if not sample_tokens:
            for s in seqs:
                s.num_cached = s.num_tokens if batch.is_prefill else s.num_cached + 1
            return [], None
        params = [s.params for s in seqs]
        history = self._history(seqs, decode=not batch.is_prefill)
        forced = [_teacher_token(s) for s in seqs]
        if any(t is not None for t in forced):
            # Teacher forcing: emit the given token, remember whether the greedy choice agreed.
            top1 = logits.argmax(-1).tolist()
            for s, t, a in zip(seqs, forced, top1):
                if t is not None:
                    s.teacher_agree.append(t == a)
            tokens = torch.tensor([a if t is None else t for t, a in zip(forced, top1)], device=logits.device)
            greedy_only = all(p.greedy or t is not None for p, t in zip(params, forced))
            if not greedy_only or batch.token_masks is not None:  # masked greedy rows: argmax after the mask
                sampled = sample(logits, params, [s.generator for s in seqs], history, batch.token_masks).tokens
                tokens = torch.where(torch.tensor([t is None for t in forced], device=logits.device), sampled, tokens)
            out = with_logprobs(logits, tokens, params)
        else:
            out = sample(logits, params, [s.generator for s in seqs], history, batch.token_masks)
        tokens = out.tokens
        self._remember_tokens(seqs, tokens, decode=not batch.is_prefill)
        for s in seqs:
            s.num_cached = s.num_tokens if batch.is_prefill else s.num_cached + 1
        return tokens.tolist(), step_logprobs(out, params, self._prompt_lp)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        mm = self.mm
        # Each prompt's first `hit` tokens come from prefix-cache blocks: only the rest is computed (queries),
        # while keys (attention, diffkv's classification and writes) span the whole prompt.
        cached = [len(s.prefix_hits) * mm.prefix_block_tokens for s in seqs]
        # Per-token rows built with numpy: a prompt step carries up to max_num_batched_tokens tokens, and
        # Python lists of that many ints (then torch.tensor of them) cost milliseconds per step.
        lens = [s.num_tokens for s in seqs]
        # A step the prompt-step graphs replay computes its cached tokens again (prefill_graph.py): `hit` is
        # then 0 everywhere, and the cached rows' writes are dropped below.
        graphed = self._graphed_prefill(sum(lens), len(seqs))
        hit = [0] * len(seqs) if graphed else cached
        n_q = [n - h for n, h in zip(lens, hit)]
        lens_np, q_np = np.array(lens, dtype=np.int64), np.array(n_q, dtype=np.int64)
        slots_np = np.array([s.slot for s in seqs], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lens_np)])
        cu_q = np.concatenate([[0], np.cumsum(q_np)])
        # recompute after preemption re-reads the outputs too
        ids = np.concatenate([np.array(s.all_token_ids[h:], dtype=np.int64) for s, h in zip(seqs, hit)])
        seq_np = np.arange(len(seqs))
        seq_of_token = np.repeat(seq_np, lens_np)
        len_of_token = np.repeat(lens_np, lens_np)
        token_slots = np.repeat(slots_np, lens_np)
        q_slots = np.repeat(slots_np, q_np)
        # position of each computed token: hit .. n-1 per sequence
        pos = np.arange(int(cu_q[-1]), dtype=np.int64) - np.repeat(cu_q[:-1] - np.array(hit, dtype=np.int64), q_np)
        self.num_prefill_tokens += len(ids)
        with_prefix = any(hit)
        prefix_lists = _cached_prefix_lists(seqs, hit, cu.tolist(), mm.prefix_block_tokens) if with_prefix else []
        # A graphed step's cached tokens: positions below their sequence's cached count, computed but not written.
        recomputed = graphed and any(cached)
        cached_of_token = [np.repeat(np.array(cached, dtype=np.int64), q_np)] if recomputed else []
        (input_ids, positions, slots, lens_t, token_slots_t, cu_t, seq_t, len_t, q_slots_t, cu_q_t,
         *rest) = self._to_device([ids, pos, slots_np, lens, token_slots, cu, seq_of_token,
                                   len_of_token, q_slots, cu_q, *prefix_lists, *cached_of_token])
        prefix_t = rest[:len(prefix_lists)]
        cached_t = rest[-1] if recomputed else None
        positions, slots, lens_t, cu_t, cu_q_t = positions.int(), slots.int(), lens_t.int(), cu_t.int(), cu_q_t.int()
        cached_prefix = None
        if with_prefix:
            key_pos, *rows = prefix_t
            cached_prefix = CachedPrefix(cu_q_t, cu_t, max(lens), key_pos.int(), *rows)
        max_pages = max(-(-n // mm.fmt_high.tokens) for n in lens)
        with cost_range("memory"):
            for s in seqs:  # cached blocks become the first (high-section) page-table columns
                mm.attach_blocks(s.slot, s.prefix_hits)
            if not self.learned:
                mm.reserve(slots, lens_t, max_pages)
        info = None
        if self.kv.diffkv:
            B, L, H = len(seqs), mm.shape.num_layers, mm.shape.num_kv_heads
            self.kv.write_slot_settings(slots, [self._kv_settings(s) for s in seqs],
                                        [len(s.prompt_token_ids) for s in seqs])
            ah, al = self.kv.prompt_alphas(token_slots_t)
            zeros = lambda: torch.zeros(B, L, H, dtype=torch.int32, device=self.device)  # noqa: E731
            info = PrefillInfo(slots, token_slots_t, seq_t, len_t.int(), cu_t, ah, al, zeros(), zeros(),
                               pin_block=mm.fmt_high.tokens if self.kv.pins_prompt_blocks else 0)
            if self.learned:
                info.overflow = torch.zeros(B, dtype=torch.bool, device=self.device)
                info.max_new_pages = max_pages + 1  # both sections rounded up: one page over all-high at most
            dst_page = dst_row = None  # each layer's policy decides where its tokens go
        else:
            with cost_range("memory"):
                mm.set_lengths(slots, lens_t)
                dst_page, dst_row = mm.write_targets(q_slots_t, positions)
                if recomputed:  # the cached blocks' pages belong to the prefix cache
                    dst_page = dst_page.masked_fill((positions < cached_t).view(1, -1, 1), -1)
        max_q = max(n - h for n, h in zip(lens, hit))
        self.attn.meta = StepMetadata(True, positions, dst_page, dst_row, slots, max_q, cu_q_t, info,
                                      cached_prefix=cached_prefix)
        with cost_range("model"):
            if graphed:  # a diffkv step's section sizes come back in info (views of the graphs' buffers)
                hidden = self.prefill_graphs.run(input_ids, positions, cu_q_t, dst_page, dst_row, info)
            else:
                hidden = self.model(input_ids, positions.long(), self.attn)
        self.kv.finish_prefill(info)
        with cost_range("memory"):  # the prompt's new full blocks: their pages now belong to the prefix cache
            for s in seqs:
                mm.adopt_blocks(s.slot, len(s.prefix_hits), s.prefix_inserts)
        with cost_range("model"):
            if self._samples:
                self._prompt_lp = self._prompt_logprobs(seqs, hit, cu_q.tolist(), hidden, input_ids)
            return self.model.logits(hidden[cu_q_t[1:].long() - 1])

    def _graphed_prefill(self, tokens: int, seqs: int) -> bool:
        """A prompt step the prompt-step graphs replay: they exist (_prefill_graph_tokens) and hold its tokens,
        cached ones included; calibration's key observers and the evals' significance probe need eager
        forwards."""
        g = self.prefill_graphs
        return (g is not None and g.fits(tokens, seqs) and self.kv.significance_probe is None
                and all(layer.key_observer is None for layer in self.model.layers))

    def _prompt_logprobs(self, seqs: list[Sequence], hit: list[int], cu_q: list[int], hidden: torch.Tensor,
                         input_ids: torch.Tensor) -> dict[int, PromptLogprobs]:
        """Prompt log-probabilities of the sequences that ask for them, at their first prefill (a recompute
        after preemption has outputs, and its prompt's were reported already). The scheduler gave them no
        prefix-cache hits, so every prompt position was computed here."""
        out = {}
        for i, s in enumerate(seqs):
            k = s.params.prompt_logprobs
            if k is None or s.output_token_ids:
                continue
            assert hit[i] == 0, "prompt_logprobs needs every prompt position computed"
            a, n = cu_q[i], len(s.prompt_token_ids)
            out[i] = prompt_logprobs(self.model.logits, hidden[a: a + n - 1], input_ids[a + 1: a + n], k)
        return out

    def _decode(self, seqs: list[Sequence], snapshot: bool = False) -> torch.Tensor:
        """Logits of one decode step. snapshot: copy the memory manager's step state to the host as soon as
        the step's memory work is done (async scheduling plans the next step with it)."""
        # all_token_ids would copy both lists; async scheduling reads the ids from token_table instead (the
        # host may not have the last token yet)
        ids = [0] * len(seqs) if self.async_steps else [(s.output_token_ids or s.prompt_token_ids)[-1] for s in seqs]
        pos = [s.num_cached for s in seqs]
        slots = [s.slot for s in seqs]
        new_lens = [s.num_cached + 1 for s in seqs]
        # Thresholds and prunable positions are read from the policy's per-slot table (written at the prefill).
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            logits = self.graphs.run(ids, pos, slots, new_lens, snapshot)
            self._decode_slots = self.graphs.ints[2, :len(seqs)]
            return logits
        input_ids, positions, slots_t, seq_len = self._to_device([ids, pos, slots, new_lens])
        self._decode_slots = slots_t
        if self.token_table is not None:
            input_ids = self.token_table[slots_t]
        positions, slots_t = positions.int(), slots_t.int()
        dst_page, dst_row = self.kv.prepare_decode(slots_t, seq_len.int())
        if snapshot:
            self.mm.snapshot_step_state()
        self.attn.meta = StepMetadata(False, positions, dst_page, dst_row, slots_t, max(new_lens))
        with cost_range("model"):
            return self.model.logits(self.model(input_ids, positions.long(), self.attn))


def _scatter(values: Optional[list], at: list[int], n: int, fill) -> Optional[list]:
    """values[j] placed at index at[j] of a list of n entries, `fill` elsewhere."""
    if values is None:
        return None
    out = [fill] * n
    for j, i in enumerate(at):
        out[i] = values[j]
    return out


def _cached_prefix_lists(seqs: list[Sequence], hit: list[int], cu: list[int], block_tokens: int) -> list[list[int]]:
    """Host lists of a CachedPrefix (after cu_seqlens): key positions, suffix rows, cached rows with their
    block and row in it."""
    key_pos, suffix, p_rows, p_blocks, p_offs = [], [], [], [], []
    for i, s in enumerate(seqs):
        n, h, start = cu[i + 1] - cu[i], hit[i], cu[i]
        key_pos.extend(range(n))
        suffix.extend(range(start + h, start + n))
        p_rows.extend(range(start, start + h))
        p_blocks.extend(b for b in s.prefix_hits for _ in range(block_tokens))
        p_offs.extend(t % block_tokens for t in range(h))
    return [key_pos, suffix, p_rows, p_blocks, p_offs]


def _teacher_token(seq: Sequence):
    t = seq.params.teacher_tokens
    n = len(seq.output_token_ids)
    return t[n] if t is not None and n < len(t) else None
