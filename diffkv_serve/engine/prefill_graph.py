"""CUDA graphs for short prompt steps (single-precision caches: fp16, int8, fp8, int4; and diffkv).

An eager prompt step launches about ten kernels per layer from Python. On an H100 host that took ~17 ms for
Qwen2.5-1.5B's 28 layers whatever the token count, while the GPU needs ~6 ms for 1,000 tokens: a prompt
step of a few thousand tokens or fewer (a new request, a sequence recomputed after preemption) waited on
the host. A graph per token bucket replays the whole forward with one launch.

A step of n tokens from B sequences pads to the next bucket T >= n: its tokens fill rows [0, n), the rest
form one padding sequence (id 0, position 0, write target page -1: nothing is stored) and the unused
sequence slots are empty. The prefill attention kernel sizes its grid by the token and sequence counts
only, so one capture serves any lengths. The logits of the sequences' last tokens are taken outside the
graph (a gather and the LM head). A prompt whose first blocks are in the prefix cache computes them again
here with their writes dropped (ModelRunner._prefill masks their targets; the cache's pages stay as they
are): the step then reads no cached K/V, whose sizes depend on the hits, and equals a step without the cache.

DiffKV caches (thresholds policy, no pinned prompt blocks) replay their prompt steps too: classification, page
fitting (or, under learned reservation, page allocation as the pages last) and section writes run per layer on
the device with grids sized by the bucket. The step's PrefillInfo is staged into static buffers; the padding
sequence and the empty ones are marked `padding` (they plan no pages and write nothing, their slot is the dummy
one, which stays empty for the decode graphs), and the section sizes (and, under learned reservation, the
overflow flags) of the real sequences are read from the static buffers after the replay.

Memory: the buckets share one private pool, captured largest first, so it holds about one largest-bucket
forward's activations (graph_memory.prefill_graph_bytes estimates it for the pool's sizing);
`memory_bytes` is what capturing took.
"""
from __future__ import annotations

import torch

from diffkv_serve.engine.attention import PagedAttention, StepMetadata
from diffkv_serve.engine.cuda_graph import reserved_by
from diffkv_serve.engine.graph_memory import prefill_buckets
from diffkv_serve.engine.kv.layout import cdiv
from diffkv_serve.engine.kv.policy import PrefillInfo
from diffkv_serve.engine.model import CausalLM


class PrefillGraphs:
    """capture=False runs each step's padded forward eagerly from the same static buffers instead of replaying
    a graph: the CPU tests check the padding and staging with it."""

    def __init__(self, model: CausalLM, attn: PagedAttention, max_tokens: int, max_seqs: int, capture: bool = True,
                 learned: bool = False):
        self.model, self.attn, self.capture, self.learned = model, attn, capture, learned
        self.buckets = prefill_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_seqs = max_seqs
        mm = attn.kv.mm
        dev = mm.device
        L, H = mm.shape.num_layers, mm.shape.num_kv_heads
        T, S = self.max_tokens, max_seqs
        self.ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.cu = torch.zeros(S + 2, dtype=torch.int32, device=dev)  # S sequences, then the padding one
        self.slots = torch.full((S,), mm.dummy_slot, dtype=torch.int32, device=dev)
        static = [self.ids, self.positions, self.cu, self.slots]
        self.diffkv = attn.kv.diffkv
        self.dst_page = self.dst_row = None  # diffkv: each layer's policy decides where its tokens go
        if not self.diffkv:  # every (layer, token, KV head)'s page and row
            self.dst_page = torch.full((L, T, H), -1, dtype=torch.int32, device=dev)
            self.dst_row = torch.zeros((L, T, H), dtype=torch.int32, device=dev)
            static += [self.dst_page, self.dst_row]
        else:  # the step's PrefillInfo, over S + 1 sequences (the padding one last)
            self.dummy_slot = mm.dummy_slot
            self.seq_slots = torch.full((S + 1,), mm.dummy_slot, dtype=torch.int32, device=dev)
            self.padding = torch.ones(S + 1, dtype=torch.bool, device=dev)
            self.token_slots = torch.full((T,), mm.dummy_slot, dtype=torch.int64, device=dev)
            self.seq_of_token = torch.zeros(T, dtype=torch.int64, device=dev)
            self.len_of_token = torch.full((T,), T, dtype=torch.int32, device=dev)
            self.alphas = torch.zeros(2, T, dtype=torch.float32, device=dev)  # high, prompt's low
            self.n_sections = torch.zeros(2, S + 1, L, H, dtype=torch.int32, device=dev)  # n_high, n_low
            self.overflow = torch.zeros(S + 1, dtype=torch.bool, device=dev)  # learned reservation only
            self.tokens_high = mm.fmt_high.tokens
            static += [self.seq_slots, self.padding, self.token_slots, self.seq_of_token, self.len_of_token,
                       self.alphas, self.n_sections, self.overflow]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, hidden)
        self.pool = None
        self.side = torch.cuda.Stream(dev) if capture else None
        self.memory_bytes = sum(t.numel() * t.element_size() for t in static)

    def fits(self, tokens: int, seqs: int) -> bool:
        return 0 < tokens <= self.max_tokens and seqs <= self.max_seqs

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (benchmarks: capture stays out of timed steps)."""
        for b in sorted(self.buckets, reverse=True):
            if b not in self.graphs:
                self._capture(b)

    def _forward(self, T: int) -> torch.Tensor:
        pos = self.positions[:T]
        info = None
        if self.diffkv:
            info = PrefillInfo(self.seq_slots, self.token_slots[:T], self.seq_of_token[:T], self.len_of_token[:T],
                               self.cu, self.alphas[0, :T], self.alphas[1, :T], self.n_sections[0],
                               self.n_sections[1], padding=self.padding)
            if self.learned:  # one head of any sequence of the bucket takes at most this many pages per layer
                info.overflow, info.max_new_pages = self.overflow, cdiv(T, self.tokens_high) + 1
        dst_page, dst_row = (None, None) if self.diffkv else (self.dst_page[:, :T], self.dst_row[:, :T])
        self.attn.meta = StepMetadata(True, pos.int(), dst_page, dst_row, self.slots, T, self.cu, info)
        return self.model(self.ids[:T], pos, self.attn)

    def _stage(self, T: int, cu: torch.Tensor | None) -> None:
        """Sequence bounds of a step in bucket T: the real ones (cu ends at its n tokens), the padding sequence
        [n, T), then empty ones."""
        B = 0 if cu is None else cu.numel() - 1
        if cu is not None:
            self.cu[: B + 1].copy_(cu)
        self.cu[B + 1:].fill_(T)

    def _capture(self, T: int) -> None:
        self.memory_bytes += reserved_by(self.ids.device, lambda: self._capture_graph(T))

    def _stage_info(self, T: int, info: PrefillInfo | None) -> None:
        """A diffkv step's PrefillInfo into the static buffers: its n tokens and B sequences, then the padding
        sequence [n, T) (the dummy slot, thresholds 0) and the empty ones, all marked padding."""
        B = 0 if info is None else info.slots.numel()
        n = 0 if info is None else info.token_slots.numel()
        if info is not None:
            self.seq_slots[:B].copy_(info.slots)
            self.token_slots[:n].copy_(info.token_slots)
            self.seq_of_token[:n].copy_(info.seq_of_token)
            self.len_of_token[:n].copy_(info.seq_len_of_token)
            self.alphas[0, :n].copy_(info.alpha_high)
            self.alphas[1, :n].copy_(info.alpha_low)
        self.seq_slots[B:].fill_(self.dummy_slot)
        self.padding[:B].fill_(False)
        self.padding[B:].fill_(True)
        if self.learned:
            self.overflow.zero_()
        self.token_slots[n:T].fill_(self.dummy_slot)
        self.seq_of_token[n:T].fill_(B)
        self.len_of_token[n:T].fill_(T - n)
        self.alphas[:, n:T].zero_()

    def _capture_graph(self, T: int) -> None:
        self.ids.zero_()
        self.positions.zero_()
        self._stage(T, None)
        if self.diffkv:
            self._stage_info(T, None)
        else:
            self.dst_page.fill_(-1)
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on padding only: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._forward(T)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            hidden = self._forward(T)
        self.pool = g.pool()
        self.graphs[T] = (g, hidden)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor,
            dst_page: torch.Tensor | None, dst_row: torch.Tensor | None,
            info: PrefillInfo | None = None) -> torch.Tensor:
        """The final hidden states [n, hidden] of a prompt step: device input_ids / positions [n], cu int32
        [B + 1], write targets int32 [L, n, H] (single precision) or the step's PrefillInfo (diffkv: its
        n_high / n_low become views of the section sizes the replay wrote); fits(n, B) must hold. The rows
        stay valid until the next run."""
        n = input_ids.numel()
        T = self.bucket(n)
        meta = self.attn.meta  # the step's own (capturing or staging sets the graphs' static one)
        if self.capture and T not in self.graphs:
            if not self.graphs and T != self.buckets[-1]:
                self._capture(self.buckets[-1])  # the largest first: smaller buckets then reuse its pool blocks
            self._capture(T)
        self.ids[:n].copy_(input_ids)
        self.ids[n:T].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:T].zero_()
        if self.diffkv:
            self._stage_info(T, info)
        else:
            self.dst_page[:, :n].copy_(dst_page)
            self.dst_page[:, n:T].fill_(-1)
            self.dst_row[:, :n].copy_(dst_row)
        self._stage(T, cu)
        if not self.capture:
            hidden = self._forward(T)
        else:
            g, hidden = self.graphs[T]
            g.replay()
        self.attn.meta = meta
        if self.diffkv:
            B = info.slots.numel()
            info.n_high, info.n_low = self.n_sections[0, :B], self.n_sections[1, :B]
            if self.learned:
                info.overflow = self.overflow[:B]
        return hidden[:n]
