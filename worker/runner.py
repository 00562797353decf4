"""One rank's model runner (the engine, scheduler and sampling loop are the launcher's, beside rank
0): builds the network, loads its shard, allocates the KV cache once, and runs compiled prefill
and decode steps.

Every index a step needs (positions, cache slots, context rows, which logits to return) is built
here from each sequence's new tokens, its count of cached tokens and its block table. With
dynamic shapes (portable and Ascend operators) each step kind compiles once and a step runs as it
is; with static shapes (the CPU kernels) steps are padded to buckets, so that the graphs compile a
few times and then run from cache, and padded tokens write to a scratch block no sequence owns.
"""

from __future__ import annotations

import os
import sys
import time
import types

import numpy as np

from msinfer.sharding.config import (MASK_PENALTY, POOLING_TASKS, EngineConfig, ModelConfig, fused, ops_problem,
                                     resolve_dtype)
from msinfer.sharding.layout import Stage, TPInfo
from msinfer.worker.protocol import (SAMPLED, DecodeChain, DecodeStep, SeqStep, StepOutput, StepReader, chains,
                                     one_by_one)
from msinfer.worker.positions import make_scheme
from msinfer.worker import sampler
from msinfer.worker.device_sampler import CANDIDATES, process_inputs, uniforms
from msinfer.worker.graph_cache import compiling, graph_folder
from msinfer.worker.imports import before_transformers

PREFILL_SPLIT_TOKENS = 1024            # see ModelRunner.execute
# A step may run in an already compiled larger shape, padded, until the padding it has cost that way
# adds up to this many tokens; then its own shape is compiled (see ModelRunner.shape). On this CPU a
# compile of the demo model costs about as much as 1500-2000 tokens of steps.
PAD_TOKENS_BEFORE_COMPILE = 1536
SAMPLER_FNS: dict[tuple, object] = {}    # see ModelRunner.sampler_fn


def bucket(n: int, minimum: int = 1) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def own_input_flags(graph, cell):
    """`graph`, a method of `cell` compiled, called with the input flags of the graph it runs.
    MindSpore's inference mode (jit's infer_boost) runs the graph compiled for the cell's `phase`
    without compiling again, with the flags (`_mutable_flags`, one an input) that the cell's
    latest compile left on the cell, whichever graph that was: a graph of one input count run
    after another's compile (a step that scores prompt tokens, 12 inputs, after a decode step's
    first, 10) stops with "The value input to flatten tensor not supported" (mindspore 2.10
    graph/api.py, _JitExecutor._predict and _generate_run_args). So each phase's flags are kept
    as its compile left them and put back before it runs."""
    flags: dict = {}

    def call(*args):
        phase = getattr(cell, "phase", None)
        if phase in flags:
            cell._mutable_flags = flags[phase]
        out = graph(*args)
        if phase not in flags:
            flags[phase] = getattr(cell, "_mutable_flags", None)
        return out
    return call


def by_shape(graph, fn):
    """`graph`, method `fn` of a cell compiled in MindSpore's inference mode (which runs the graph
    the cell's `phase` names, whatever the inputs' shapes), called with a phase of `fn`'s name and
    the inputs' shapes: one graph a shape, as MindSpore keys graphs in its other modes."""
    cell, name = fn.__self__, fn.__name__
    graph = own_input_flags(graph, cell)

    def call(*args):
        cell.phase = name + "".join(str(getattr(a, "shape", a)) for a in args)
        return graph(*args)
    return call


def shape_key(inputs: dict) -> str:
    """The graph shape of a step's inputs (see ModelRunner.prepare)."""
    return f"N={inputs['input_ids'].shape[0]} M={inputs['out_index'].shape[0]}"


def draw_parameters(params: list, generated: np.ndarray, rows, M: int) -> tuple:
    """VocabSampler.sample's per-row inputs for M rows, of which `rows` draw with `params` after
    `generated` tokens each: temperature, top_k (int32), top_p, min_p and the row's uniform
    (worker.device_sampler.uniforms: its stream, tokens generated, sample index); other rows greedy."""
    temperature, top_p, min_p, draw = (np.zeros(M, np.float32), np.ones(M, np.float32), np.zeros(M, np.float32),
                                       np.zeros(M, np.float32))
    top_k = np.zeros(M, np.int32)
    u = uniforms(np.array([p.draw_key for p in params], np.int64), generated, np.array([p.index for p in params]))
    for i, p, x in zip(rows, params, u):
        temperature[i], top_k[i], top_p[i], min_p[i], draw[i] = p.temperature, p.top_k, p.top_p, p.min_p, x
    return temperature, top_k, top_p, min_p, draw


class ModelRunner:
    def __init__(self, ec: EngineConfig, tp: TPInfo = TPInfo()):
        import mindspore as ms
        from msinfer.worker.model import CausalLM
        from msinfer.worker.device import select_ops
        from msinfer.worker.loader import load_checkpoint, read_tensor
        from msinfer.worker.lora import with_lora

        self.ms = ms
        self.ec, self.tp = ec, tp
        self.cfg = ModelConfig.from_dir(ec.model_dir)
        if ec.task in POOLING_TASKS:
            self.cfg = self.cfg.pooling_only()
        if ec.head_tokens:
            self.cfg = self.cfg.token_classifier(ec.head_tokens)
        self.dtype = resolve_dtype(ec.dtype, self.cfg, ec.device, ec.emulate, ec.ops)
        self.scheme = make_scheme(ec.position_scheme, **ec.position_options)
        self.block_size = ec.block_size
        self.num_blocks = ec.blocks()
        self.scratch_block = self.num_blocks                 # padding writes land here
        t0 = time.perf_counter()
        self.max_blocks_per_seq = -(-ec.max_model_len // self.block_size)
        if ec.emulate:
            from msinfer.worker.ascend import set_variants
            set_variants(ec.emulate_variants)
        self.dev = select_ops(ec.device, ec.ops, ec.threads, ec.emulate)
        self.dynamic = self.dev.dynamic_shapes if ec.shapes == "auto" else ec.shapes == "dynamic"
        # (PyNative with the fused kernels is refused by the plan, not here: tests record the
        # kernels' calls eagerly on the emulated path)
        if problem := ops_problem(ec.device, ec.ops, ec.shapes):
            raise ValueError(problem)
        self.kernel_check = None
        if hasattr(self.dev, "with_conventions") and ec.kernel_check:   # the fused kernels: the card settles them
            self.kernel_check = self.check_kernels()
        self.stage = Stage.of(ec.pipeline, ec.stage)
        if ec.matmul_dtype == "bfloat16" and self.dev.pack_pairs is None:
            raise ValueError(f"matmul_dtype bfloat16 needs the CPU kernels, not {self.dev.name}'s operators")
        self.model = CausalLM(self.cfg, tp, getattr(ms, self.dtype), self.dev, self.num_blocks + 1,
                              self.scheme.freq_matrix(self.cfg), self.block_size, self.stage,
                              ms.uint16 if ec.kv_bfloat16(self.cfg) else None)    # (the bits of bfloat16 values)
        self.model.set_train(False)
        # before the weights load: they are packed as each layer loads
        self.model.bf16_matmuls = ec.matmul_dtype == "bfloat16"
        if ec.random_weights:   # the model's shapes only: timing runs without the checkpoint
            self.load_stats = {"tensors": 0, "bytes": 0}
        else:
            self.load_stats = load_checkpoint(with_lora(self.model, ec.lora_path, ec.lora_scale), ec.model_dir,
                                              ec.allow_pickle, self.cfg.quant, self.model.pack_layer)
        self.model.pack_weights()
        self.model.pack_greedy_head()
        self.fused_layers = self.model.fuse()        # (layers with any part of them fused)
        self.head = None                         # task classify: the classifier's head, on the host
        if ec.task == "classify" and self.stage.last:
            self.head = (np.zeros((self.cfg.num_labels, self.cfg.hidden_size), np.float32) if ec.random_weights
                         else read_tensor(ec.model_dir, self.cfg.head_tensor, ec.allow_pickle,
                                          self.cfg.head_tokens or None))
        if self.load_stats["bytes"]:          # as held: packing may change a weight's bytes (int8, tiles)
            self.load_stats["bytes"] = sum(p.nbytes for p in self.model.held_parameters())
        self.load_s = time.perf_counter() - t0
        # One function per step kind (see CausalLM); the CPU kernels' attention is the same for both
        # kinds, so their prefill steps run the decode graph (not latent attention's, which differs:
        # worker.model.MLAttention).
        kinds = {"prefill": self.model.prefill, "decode": self.model.decode}
        if self.stage.last and self.cfg.lm_head:     # the stages before it only pass hidden states on
            kinds.update(score=self.model.score, score_top=self.model.score_top)
        elif self.stage.last:                    # embed, classify: their prefills' final hidden states
            kinds["pool"] = self.model.pool
        if self.dev.fused_attention and self.cfg.mla is None:
            kinds["prefill"] = self.model.decode
        # decode steps in one call (`chain`): static shapes (the loop unrolls as the graph
        # compiles for its number of steps), one stage, a device whose step kinds share one phase
        if self.stage.count == 1 and self.cfg.lm_head and not self.dynamic and not self.dev.phases:
            kinds["chain"] = self.model.decode_chain
        self.fns = {kind: self.compiled(fn, kind) for kind, fn in kinds.items()} if ec.graph_mode else kinds
        if kinds["prefill"] == kinds["decode"] and not self.dev.phases:   # one graph a shape, not one a kind
            self.fns["prefill"] = self.fns["decode"]
        self.step_fn = self.fns["decode"]
        self.compile_s: dict[str, float] = {}
        self.graphs: set[tuple[int, int]] = set()           # (N, M) shapes the step graphs have run
        self.compiled_graphs: set[tuple] = set()             # (kind, and shapes when static) of each graph run
        self.graph_parts: tuple | None = None                # what every graph's cache folder is keyed by
        self.model_s = 0.0                                   # seconds on the device, all steps (see step)
        self.synced = 0.0                                    # when the last copy to the host ended
        self.last_call: tuple = ({}, "decode")               # the inputs and kind of the last network call
        self.pad_debt: dict[tuple[int, int], int] = {}       # see shape()
        self.steps = StepReader()                            # a DecodeStep's rows, completed
        self.sampled: dict[int, int] = {}                    # seq_id -> its token of the last step (SAMPLED)
        self.histories: dict[int, sampler.History] = {}     # seq_id -> what its sampling looks back at
        self.grammar_tokenizer = None                        # llguidance's, loaded for the first grammar
        self.mask_pool = self.grammar_executor = None        # start_masks' thread and llguidance's pool
        self.host_bytes = 0                                  # copied from the device, all steps

    def kv_bytes(self) -> int:
        """Bytes of this rank's KV cache (every layer's K and V, or its latents, the scratch block included)."""
        return sum(c.size * c.itemsize for layer in self.model.layers for c in layer.self_attn.caches())

    def check_kernels(self) -> dict:
        """The start-up kernel self-check at this rank's shapes (worker.kernel_check), from the
        cache when these cards were checked before; the seam then follows its verdicts."""
        from msinfer.worker import kernel_check
        results = kernel_check.cached_check(self.dev, *kernel_check.check_shapes(self.cfg, self.tp.size, self.block_size,
                                                                                 self.dtype))
        self.dev = self.dev.with_conventions(kernel_check.conventions(results))
        print(f"msinfer rank {self.tp.rank}: {kernel_check.describe(results)}", flush=True)
        return results

    def compiled(self, fn, kind: str):
        """`fn` as a static graph; with dynamic shapes, one graph for every token and sequence count."""
        if not self.dynamic:
            options = self.dev.static_step_jit_options
            return by_shape(self.ms.jit(fn, **options), fn) if options else \
                own_input_flags(self.ms.jit(fn, **self.dev.jit_options), fn.__self__)
        from msinfer.worker.model import POOL_INPUTS, SCORE_INPUTS, STEP_INPUTS
        ms = self.ms
        dims = {"positions": ([None, self.scheme.num_components], ms.float32), "block_tables": ([None, None], ms.int32),
                "attn_mask": ([None, None], getattr(ms, self.dtype)),
                "hidden": ([None, self.cfg.hidden_size], ms.float32)}
        names = (SCORE_INPUTS if kind.startswith("score") else POOL_INPUTS if kind == "pool" else STEP_INPUTS) + (
            () if self.stage.first else ("hidden",))
        return own_input_flags(self.dynamic_graph(fn, {n: dims.get(n, ([None], ms.int32)) for n in names}),
                               fn.__self__)

    def dynamic_graph(self, fn, specs: dict):
        """Method `fn` compiled once for inputs of variable size (mindspore.enable_dynamic: each
        input's variable dims declared None, by name; specs: name -> (shape, dtype))."""
        ms = self.ms
        # enable_dynamic keeps its shapes on the function object, which a bound method shares with
        # every instance: each gets a function of its own (same code, so the same input names)
        f = fn.__func__
        own = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        own.__qualname__ = f.__qualname__
        graph = ms.jit(types.MethodType(own, fn.__self__), **self.dev.jit_options)
        return ms.enable_dynamic(**{n: ms.Tensor(shape=shp, dtype=dt) for n, (shp, dt) in specs.items()})(graph)

    def sampler_fn(self, name: str, candidates: int = CANDIDATES, logprobs: int = 0, passes=(False, False),
                   masked: bool = False):
        """worker.device_sampler's function `name` over this rank's vocabulary shard, compiled once
        per (name, C, K, its passes: mass_pass, draw_pass, masked) for any number of rows (per row count
        with the CPU kernels, whose custom operators take static shapes), and shared by the
        runners of a process that have the same vocabulary shard (a compile of `sample` as
        MindSpore's operators takes over a second)."""
        key = (name, candidates, logprobs, passes, masked, self.cfg.vocab_size, self.tp.rank, self.tp.size,
               self.ec.graph_mode, self.dev.name, tuple(sorted(self.dev.jit_options.items())))
        if key not in SAMPLER_FNS:
            from msinfer.worker.device_sampler import VocabSampler
            kernels = self.dev.sampler_kernels
            fn = getattr(VocabSampler(self.cfg.vocab_size, self.tp, candidates, logprobs, kernels=kernels,
                                      mass_pass=passes[0], draw_pass=passes[1], masked=masked), name)
            if self.ec.graph_mode and kernels is not None:     # custom operators: static shapes (worker.cpu)
                fn = self.ms.jit(fn, **self.dev.jit_options)
            elif self.ec.graph_mode:
                ms = self.ms
                rows = ([None], ms.float32)
                specs = {"logits": ([None, fn.__self__.per], ms.float32)}
                if name == "sample":
                    specs.update(temperature=rows, top_k=([None], ms.int32), top_p=rows, min_p=rows, u=rows)
                elif name == "logprob":
                    specs.update(targets=([None], ms.int32))
                elif name == "process":
                    specs.update(entries=([None, 5], ms.float32), mask=([None, None], ms.int32))
                fn = self.dynamic_graph(fn, specs)
            SAMPLER_FNS[key] = fn
        return SAMPLER_FNS[key]

    def to_host(self, out, rows: int | None = None):
        """A step's outputs (a tensor or a tuple of them) as numpy, counted in host_bytes, cut to
        their first `rows` rows on the host: the rows that pad a static shape are copied too (a
        few bytes each; slicing them off on the device costs more than it saves)."""
        many = isinstance(out, tuple)
        out = out if many else (out,)
        try:
            out = tuple(o.asnumpy() for o in out)
        except RuntimeError as e:          # a device runs the graphs asynchronously: a kernel's failure shows here
            raise self.kernel_error(e, *self.last_call) from e
        self.synced = time.perf_counter()
        self.host_bytes += sum(o.nbytes for o in out)
        out = tuple(o[:rows] for o in out) if rows is not None else out
        return out if many else out[0]

    # ---- inputs -------------------------------------------------------------------------------
    def shape(self, n_tok: int, n_seqs: int, is_prefill: bool, reuse: bool = True,
              square: bool = False) -> tuple[int, int]:
        """The (N, M) a step of n_tok tokens of n_seqs sequences runs in. With dynamic shapes, its
        own. Else power-of-two buckets (N at least 64 for a prefill, 8 for a decode; M holds the
        logit rows), or, with `reuse`, the next larger bucket if it is compiled, padded, while the
        padding such steps have cost stays under PAD_TOKENS_BEFORE_COMPILE tokens: a compile costs
        seconds, a few padded steps less (rent until the rent paid equals the price). The choice
        depends only on the steps run so far, so every rank of a group makes the same one.
        `square`: a compiled shape of as many tokens as logit rows only (a chain's: decode_chain
        feeds a step's M tokens to the next as its N)."""
        if self.dynamic:
            return n_tok, n_seqs
        if is_prefill:
            N = bucket(n_tok, 64)
            M = min(bucket(max(n_seqs, self.ec.max_batch_size)), N)
        else:
            N = M = bucket(n_tok, min(8, bucket(self.ec.max_batch_size)))
        if not reuse or (N, M) in self.graphs:
            return N, M
        fits = sorted((n, m) for n, m in self.graphs if N <= n <= 2 * N and m >= n_seqs and (n == m or not square))
        if not fits:
            return N, M
        debt = self.pad_debt.get((N, M), 0) + fits[0][0] - N
        if debt >= PAD_TOKENS_BEFORE_COMPILE:
            return N, M
        self.pad_debt[(N, M)] = debt
        return fits[0]

    def prepare(self, seqs: list[SeqStep], is_prefill: bool, reuse: bool = True,
                paged: bool = True, hidden: np.ndarray | None = None, chain: int = 1) -> tuple[dict, list[int]]:
        """The step's input tensors by name (see CausalLM) and the first row of each sequence's tokens.

        The sequences' new tokens are packed one after another into N rows, with no padding
        between them; each token sees the first (its position + 1) positions of its own sequence,
        read through the sequence's block table. A decode step brings one token per sequence, a
        prefill step whole prompts (or their uncached tails).

        N and M (the returned logit rows) come from `shape`. With static shapes the block tables
        are as wide as max_model_len, so the graphs compile for a handful of shapes and then run
        from cache; padded tokens see nothing and write to a scratch block no sequence owns. With
        dynamic shapes nothing is padded and the tables are as wide as the step's longest sequence.
        `paged`: the step attends through the block tables (any kind but `prefill`), so a device
        with `paged_mask` gets the causal mask of its chunks. `hidden`: a pipeline stage's input,
        the stage before's hidden states of the step's tokens ([total, hidden_size]), padded to N.
        `chain` > 1: the inputs of that many decode steps of `seqs`, each a position further
        (CausalLM.decode_chain): positions, slot_mapping, batch_valid_length and token_len with a
        leading dimension of one row a step; the block tables must hold the last step's token."""
        P = self.scheme.num_components
        bs = self.block_size
        scratch = self.scratch_block * bs
        B = len(seqs)
        n = np.fromiter((len(s.token_ids) for s in seqs), np.int64, B)
        start = np.fromiter((s.num_cached for s in seqs), np.int64, B)
        blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, B)
        short = np.flatnonzero(blocks * bs < start + n + chain - 1)
        if len(short):
            s = seqs[short[0]]
            raise ValueError(f"sequence {s.seq_id}: block table holds {len(s.block_table)} blocks, too few "
                             f"for {s.num_cached + len(s.token_ids) + chain - 1} tokens")
        total = int(n.sum())
        N, M = self.shape(total, B, is_prefill, reuse, square=chain > 1)
        if self.dynamic:
            width = max(1, int((-(-(start + n) // bs)).max()))
        else:
            width = max([self.max_blocks_per_seq] + [bucket(b) for b in blocks.tolist() if b > self.max_blocks_per_seq])
        first = np.cumsum(n) - n                    # each sequence's first row
        seq_of = np.repeat(np.arange(B), n)         # each token's sequence
        pos = np.arange(total) - first[seq_of] + start[seq_of]
        tables = np.full((M, width), self.scratch_block, np.int32)
        for b, s in enumerate(seqs):
            k = min(len(s.block_table), width)
            tables[b, :k] = s.block_table[:k]
        named = tables[:B][np.arange(width)[None] < np.minimum(blocks, width)[:, None]]
        if len(named) and (named.min() < 0 or named.max() >= self.num_blocks):   # writes outside the cache
            s = next(s for s in seqs if any(not 0 <= x < self.num_blocks for x in s.block_table))
            raise ValueError(f"sequence {s.seq_id}: block table names a block outside the KV cache's "
                             f"{self.num_blocks}: {s.block_table}")
        ids = np.full(N, self.dev.pad_id, np.int32)
        ids[:total] = np.fromiter((t for s in seqs for t in s.token_ids), np.int32, total)
        rope = np.zeros((N, P), np.float32)
        rope[:total] = self.scheme.at(pos)
        slots = np.full(N, scratch, np.int32)
        slots[:total] = tables[seq_of, pos // bs] * bs + pos % bs
        token_seq = np.zeros(N, np.int32)
        token_seq[:total] = seq_of
        token_len = np.zeros(N, np.int32)
        token_len[:total] = pos + 1
        valid_len = np.zeros(M, np.int32)
        valid_len[:B] = start + n
        q_lens = np.zeros(M, np.int32)
        q_lens[:B] = n
        if paged and self.dev.paged_mask and n.max(initial=0) > 1:     # 0 / -10000 past each token's position
            mask = np.where(np.arange(width * bs)[None, :] > np.append(pos, np.zeros(N - total, np.int64))[:, None],
                            np.float32(MASK_PENALTY), np.float32(0))
        else:
            mask = np.zeros((1, 1), np.float32)
        out_index = np.full(M, -1, np.int32)
        out_index[:B] = first + n - 1
        if chain > 1:                       # step k: every token k positions further
            later = pos + np.arange(chain)[:, None]                  # [chain, total]
            rope = np.zeros((chain, N, P), np.float32)
            rope[:, :total] = self.scheme.at(later.ravel()).reshape(chain, total, P)
            slots = np.full((chain, N), scratch, np.int32)
            slots[:, :total] = tables[seq_of, later // bs] * bs + later % bs
            token_len = np.zeros((chain, N), np.int32)
            token_len[:, :total] = later + 1
            valid_len = np.zeros((chain, M), np.int32)
            valid_len[:, :B] = start + n + np.arange(chain)[:, None]
        # Tensor.from_numpy shares each array (built above in its input's dtype, and never changed
        # after): ~1 us a tensor against ~7 for Tensor(array, dtype), whose checks cost a decode
        # step ~60 us. The mask of a float16 or bfloat16 network converts.
        T_ = self.ms.Tensor.from_numpy
        inputs = {"input_ids": T_(ids), "positions": T_(rope), "slot_mapping": T_(slots), "block_tables": T_(tables),
                  "batch_valid_length": T_(valid_len), "q_seq_lens": T_(q_lens), "token_seq": T_(token_seq),
                  "token_len": T_(token_len), "attn_mask": T_(mask) if self.dtype == "float32" else
                  self.ms.Tensor(mask, getattr(self.ms, self.dtype)), "out_index": T_(out_index)}
        if not self.stage.first:
            if hidden is None or hidden.shape != (total, self.cfg.hidden_size):
                raise ValueError(f"pipeline stage {self.stage.index}: expected the stage before's hidden states "
                                 f"[{total}, {self.cfg.hidden_size}], got "
                                 f"{None if hidden is None else list(hidden.shape)}")
            rows = np.zeros((N, self.cfg.hidden_size), np.float32)
            rows[:total] = hidden
            inputs["hidden"] = T_(rows)
        return inputs, first.tolist()

    def kind(self, seqs: list[SeqStep], is_prefill: bool) -> str:
        """`prefill` when no sequence of the step has cached tokens, else `decode` (see CausalLM)."""
        return "prefill" if is_prefill and all(s.num_cached == 0 for s in seqs) else "decode"

    # ---- steps ----------------------------------------------------------------------------------
    def network(self, seqs: list[SeqStep], is_prefill: bool, score: bool = True, hidden=None):
        """Runs the network of one step: (this rank's vocabulary shard of the last-token logits,
        [M, per], and each row's greedy token [M], both left on the device; per sequence, the
        log-probabilities of its targets when any sequence of a prefill scores (and `score`),
        else None). A pipeline stage takes the stage before's hidden states (`hidden`, see
        prepare); one but the last gives (its hidden states [N, hidden_size], None, None)."""
        if score and is_prefill and self.stage.last and any(s.targets for s in seqs):
            return self.forward_scores(seqs, hidden)
        if is_prefill and self.stage.last and not self.cfg.lm_head:
            return self.forward_pooled(seqs, hidden)
        kind = self.kind(seqs, is_prefill)
        inputs, _ = self.prepare(seqs, is_prefill, paged=kind != "prefill", hidden=hidden)
        if not self.stage.last:
            return self._call(kind, inputs), None, None
        return *self._call(kind, inputs), None

    def _call(self, kind: str, inputs: dict, *extra):
        """Runs a compiled step of `kind`; the first call of each graph (its compile) is timed in
        compile_s: by kind with dynamic shapes, by kind and shape with static ones."""
        from msinfer.worker.model import STEP_INPUTS
        shape = (inputs["input_ids"].shape[0], inputs["out_index"].shape[0])
        fn = self.fns[kind]
        if kind == "chain":         # one graph a shape, number of steps and way of picking: its draws' shape
            draws = extra[0]
            extra_dims, label = draws.shape[::2], f" K={draws.shape[0]}{' sampled' if draws.shape[-1] > 1 else ''}"
        else:
            extra_dims, label = tuple(e.shape[0] for e in extra), f" S={extra[0].shape[0]}" if extra else ""
        graph = (kind if fn is not self.step_fn else "decode",) + (() if self.dynamic else shape + tuple(extra_dims))
        t0 = time.perf_counter()
        if self.dev.phases:
            self.model.phase = self.dev.phases[kind]
        self.last_call = (inputs, kind)
        folder = self.graph_folder(graph) if graph not in self.compiled_graphs and self.ec.compile_cache else None
        try:
            with compiling(folder):
                out = fn(*(inputs[name] for name in STEP_INPUTS), *extra,
                         *((inputs["hidden"],) if "hidden" in inputs else ()))
        except RuntimeError as e:
            raise self.kernel_error(e, inputs, kind) from e
        if graph not in self.compiled_graphs:
            self.compiled_graphs.add(graph)
            self.compile_s[kind if self.dynamic else f"{kind} {shape_key(inputs)}{label}"] = time.perf_counter() - t0
        if not kind.startswith(("score", "pool", "chain")):
            self.graphs.add(shape)
        return out

    def graph_folder(self, graph: tuple):
        """The compile cache's folder of step graph `graph` (worker.graph_cache): keyed by the model,
        this rank's EngineConfig (less the card's measured figures and the threads), its place in
        the replica, the device's ops and kernel conventions, its parameters' names, dtypes and
        shapes as loaded (which layers hold int8 weights depends on the checkpoint's values), the
        CPU kernels' library and msinfer's environment variables (a CPU feature overridden, or
        MSINFER_INFER_BOOST) and how its group sums (sharding.layers.ALL_REDUCE)."""
        import dataclasses

        from msinfer.sharding import layers
        if self.graph_parts is None:
            params = sorted((p.name, str(p.dtype), tuple(p.shape)) for p in self.model.get_parameters())
            ec = dataclasses.replace(self.ec, card=None, card_env={}, threads=0)
            self.graph_parts = (repr(self.cfg), repr(ec), self.tp, self.dtype, self.dev.__name__,
                                getattr(self.dev, "conventions", {}), params, self.dynamic,
                                getattr(sys.modules.get("msinfer.worker.cpu"), "_LIBRARY", None),
                                sorted((k, v) for k, v in os.environ.items() if k.startswith("MSINFER_")),
                                layers.ALL_REDUCE.__name__)
        return graph_folder(*self.graph_parts, graph)

    def kernel_error(self, error: RuntimeError, inputs: dict, kind: str) -> Exception:
        """On the Ascend path, a failure MindSpore blames on a fused kernel becomes a KernelError
        that names it (worker.ascend.kernel_error); on the CPU, a node group's collective that
        failed says why (worker.device.node_group_error); anything else stays as it was."""
        if not fused(self.ec.device, self.ec.ops):
            from msinfer.worker.device import node_group_error
            return node_group_error(error) or error
        from msinfer.worker.ascend import kernel_error
        attn = self.model.layers[0].self_attn
        held = next(((layer.mlp.experts.count, layer.mlp.experts.inter) for layer in self.model.layers
                     if hasattr(layer.mlp, "experts")), None)
        return kernel_error(error, inputs, kind, self.cfg, (attn.heads, attn.kv_heads), self.dtype,
                            self.block_size, held) or error

    def parts(self, seqs: list[SeqStep], is_prefill: bool) -> list[list[SeqStep]]:
        """The step as it runs: a prefill of more than PREFILL_SPLIT_TOKENS as several, by whole
        sequences (a static graph holds every intermediate of its step, about 1 MB a token for the
        demo model, and each token bucket is one more graph to compile)."""
        if not is_prefill or len(seqs) < 2 or sum(len(s.token_ids) for s in seqs) <= PREFILL_SPLIT_TOKENS:
            return [seqs]
        groups, size = [[]], 0
        for s in seqs:
            if groups[-1] and size + len(s.token_ids) > PREFILL_SPLIT_TOKENS:
                groups.append([])
                size = 0
            groups[-1].append(s)
            size += len(s.token_ids)
        return groups

    def execute(self, seqs: list[SeqStep], is_prefill: bool, score: bool = True) -> tuple[np.ndarray, list | None]:
        """One step's whole last-token logits [len(seqs), vocab] float32, gathered from the
        vocabulary shards, and the log-probabilities of each sequence's targets when any scores:
        what the network computes, for tests and measurements (a job's steps sample on the
        device and copy no logits, see `step`)."""
        logits, scores = [], []
        for part in self.parts(seqs, is_prefill):
            out, _, part_scores = self.network(part, is_prefill, score)
            logits.append(self.to_host(self.sampler_fn("full")(out), len(part)))
            scores += part_scores or [None] * len(part)
        return np.concatenate(logits), None if all(x is None for x in scores) else scores

    def forward(self, seqs: list[SeqStep], is_prefill: bool) -> np.ndarray:
        """One step's whole last-token logits [len(seqs), vocab] (see execute), nothing scored."""
        return self.execute(seqs, is_prefill, score=False)[0]

    def forward_scores(self, seqs: list[SeqStep], hidden=None):
        """A prefill that also returns, per sequence, (log p(targets[j] | its tokens up to j), the
        target's rank) for every j with targets[j] >= 0 (None for a sequence without targets; with
        `prompt_logprobs: k`, each with [(token, log-probability)] of the k most likely third); the
        rank counts the tokens at least as likely as the target (1: the most likely). The
        last-token logits and greedy tokens stay on the device, as `network` leaves them. The scored
        rows are padded to a bucket of 16 so that scoring adds few compiled shapes (static shapes)."""
        from msinfer.worker.model import PROMPT_TOP
        inputs, first_row = self.prepare(seqs, True, reuse=False, hidden=hidden)
        rows, targets, counts = [], [], []
        for b, s in enumerate(seqs):
            t = list(s.targets or ())
            if t and len(t) != len(s.token_ids):
                raise ValueError(f"sequence {s.seq_id}: {len(t)} targets for {len(s.token_ids)} tokens")
            picked = [(j, tok) for j, tok in enumerate(t) if tok >= 0]
            if any(tok >= self.cfg.vocab_size for _, tok in picked):
                raise ValueError(f"sequence {s.seq_id}: a target token is outside the vocabulary")
            rows += [first_row[b] + j for j, _ in picked]
            targets += [tok for _, tok in picked]
            counts.append(len(picked) if t else None)
        S = len(rows) if self.dynamic else bucket(len(rows), 16)
        score_index = np.zeros(S, np.int32)
        score_index[: len(rows)] = rows
        score_targets = np.zeros(S, np.int32)
        score_targets[: len(rows)] = targets
        i32 = self.ms.int32
        top = [s.sampling.prompt_logprobs or 0 for s in seqs]
        logits, greedy, logp = self._call("score_top" if any(top) else "score", inputs,
                                          self.ms.Tensor(score_index, i32), self.ms.Tensor(score_targets, i32))
        logp = self.to_host(logp, len(rows))
        scores, at, K = [], 0, PROMPT_TOP
        for n, k in zip(counts, top):
            if n is None:
                scores.append(None)
            elif not k:      # (log p(target), its rank)
                scores.append([(float(r[0]), int(r[1])) for r in logp[at: at + n]])
            else:            # (log p(target), its rank, [(token, log-probability)] of the k most likely)
                scores.append([(float(r[0]), int(r[1]), [(int(t), float(v)) for t, v in zip(r[2 + K: 2 + K + k],
                                                                                           r[2: 2 + k])])
                               for r in logp[at: at + n]])
            at += n or 0
        return logits, greedy, scores

    def forward_pooled(self, seqs: list[SeqStep], hidden=None):
        """A prefill of task embed (or classify): per sequence, what its tokens in this step add
        to its pooled embedding (SamplingParams.pooling), as float32 [hidden_size]: `last`, the final norm's
        hidden state of its last token in the step (the prompt's last, once the engine has fed it
        all); `cls`, of its first position, where the step feeds it (else None); `mean`, the sum
        over its tokens, which the engine divides by the prompt's length. The rows are padded to
        a bucket of 16 (static shapes), as forward_scores' are. Task classify pools the last token
        and hands back the classifier's logits of it ([num_labels], its head applied on the
        host: a few thousand multiply-adds a sequence). Returns (None, None, those)."""
        inputs, first_row = self.prepare(seqs, True, reuse=False, hidden=hidden)
        rows, spans = [], []
        for b, s in enumerate(seqs):
            n, how = len(s.token_ids), s.sampling.pooling
            picked = (range(first_row[b], first_row[b] + n) if how == "mean" else [first_row[b] + n - 1]
                      if how == "last" else [first_row[b]] if how == "cls" and s.num_cached == 0 else [])
            spans.append((len(rows), len(picked)))
            rows += picked
        S = max(1, len(rows)) if self.dynamic else bucket(len(rows), 16)
        pool_index = np.zeros(S, np.int32)
        pool_index[: len(rows)] = rows
        states = self.to_host(self._call("pool", inputs, self.ms.Tensor(pool_index, self.ms.int32)), len(rows))
        pooled = [states[at: at + n].sum(0) if n else None for at, n in spans]
        if self.head is not None:
            pooled = [None if v is None else self.head @ v for v in pooled]
        return None, None, pooled

    def grammar(self, text: str):
        """A matcher of a structured-output grammar (llguidance), over the model's tokenizer,
        which this rank loads the first time a sequence asks for one."""
        import llguidance
        if self.grammar_tokenizer is None:
            before_transformers()
            import llguidance.hf
            import transformers
            tok = transformers.AutoTokenizer.from_pretrained(self.ec.tokenizer_path or self.ec.model_dir,
                                                             trust_remote_code=self.ec.trust_remote_code)
            self.grammar_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=self.cfg.vocab_size)
        return llguidance.LLMatcher(self.grammar_tokenizer, text, log_level=0)

    def sample(self, seqs: list[SeqStep], logits, greedy, logprobs: bool, masks=None) -> tuple[list[int], list]:
        """The step's tokens (-1 where a sequence does not sample) and per sequence its
        (chosen log-probability, [(token, log-probability)] of the `sampling.logprobs` most likely)
        or None, all on the device (worker.device_sampler): the network's greedy tokens when every
        sequence is greedy without logprobs, its `greedy_logprobs` when every one is greedy, else
        its `sample` function, whose variant every rank picks alike from the sequences. A step
        with sequences whose sampling changes their logits first (penalties, biases, bans, token
        masks, a grammar) runs `process` on the logits before: its tokens come from the changed
        logits, log-probabilities from the model's own (`greedy_logprobs` and `score` on them).
        `logprobs`: format them (rank 0; the other ranks compute and drop them); `masks`: the
        grammars' (`start_masks`)."""
        chosen, lps = [-1] * len(seqs), [None] * len(seqs)
        todo = [i for i, s in enumerate(seqs) if s.sample]
        if not todo:
            return chosen, lps
        params = [seqs[i].sampling for i in todo]
        k = max(p.logprobs for p in params)
        raw = logits
        if any(p.processes for p in params):
            logits = self.processed(seqs, todo, logits, masks)
            greedy = None
        if k == 0 and all(p.greedy for p in params):
            picked = self.to_host(greedy if greedy is not None else self.sampler_fn("greedy")(logits),
                                  len(seqs))[todo].tolist()
            figures = None
        elif all(p.greedy for p in params) and greedy is not None:
            out = self.to_host(self.sampler_fn("greedy_logprobs", k, k)(logits), len(seqs))
            picked, figures = out[0][todo].tolist(), out[1]
        else:
            temperature, top_k, top_p, min_p, draw = draw_parameters(
                params, np.array([seqs[i].num_generated for i in todo]), todo, logits.shape[0])
            widest = int(top_k.max())
            C = CANDIDATES if widest <= CANDIDATES else bucket(widest)
            drawn = [p for p in params if not p.greedy and p.top_k == 0]   # kept tokens beyond the candidates
            passes = (False, False) if self.tp.size == 1 and self.dev.sampler_kernels is not None else (
                any(p.min_p > 0 for p in drawn), any(p.top_p >= 1 for p in drawn))
            K = k if greedy is not None else 0            # changed logits: log-probabilities from the raw ones
            T_ = self.ms.Tensor.from_numpy          # (as prepare's inputs)
            out = self.to_host(self.sampler_fn("sample", C, K, passes)(
                logits, T_(temperature), T_(top_k), T_(top_p), T_(min_p), T_(draw)), len(seqs))
            tokens, figures = out if K else (out, None)   # figures: chosen, top-k log-probabilities, their ids
            picked = tokens[todo].tolist()
        if k and figures is None:        # the model's own log-probabilities of the tokens drawn from changed logits
            tokens = np.zeros(logits.shape[0], np.int32)
            tokens[todo] = picked
            figures = self.to_host(self.sampler_fn("greedy_logprobs", k, k)(raw), len(seqs))[1]
            figures[:, 0] = self.to_host(self.sampler_fn("logprob")(raw, self.ms.Tensor(tokens)), len(seqs))
        if figures is not None:
            for i, p, token in zip(todo, params, picked):
                if logprobs and p.logprobs:
                    top = [(int(t), float(x)) for t, x in zip(figures[i, 1 + k: 1 + k + p.logprobs],
                                                              figures[i, 1: 1 + p.logprobs])]
                    # the chosen token's log-probability is its entry in top where it has one: one
                    # figure, not a second computation that may round differently
                    lps[i] = (next((x for t, x in top if t == token), float(figures[i, 0])), top)
        for i, t in zip(todo, picked):
            chosen[i] = t
        return chosen, lps

    def processed(self, seqs: list[SeqStep], todo: list[int], logits, grammar):
        """The step's logits after `process` (worker.device_sampler): each sampling sequence's
        worker.sampler.Adjustments, from its history on this rank, and the grammars' masks
        (`start_masks`: a Future, or None)."""
        adjustments = {i: sampler.Adjustments(seqs[i].sampling, seqs[i].num_generated,
                                              self.histories.get(seqs[i].seq_id), self.cfg.vocab_size, grammar=False)
                       for i in todo if seqs[i].sampling.processes}
        entries, mask, masked = process_inputs(adjustments, logits.shape[0], self.cfg.vocab_size,
                                               static=self.dev.sampler_kernels is not None,
                                               grammar=grammar.result() if grammar is not None else None)
        return self.sampler_fn("process", masked=masked)(logits, self.ms.Tensor(entries), self.ms.Tensor(mask))

    def start_masks(self, seqs: list[SeqStep]):
        """The token masks of the step's sequences that follow a grammar, computed while the network
        runs: llguidance fills them in parallel (its own threads, outside the GIL) into int32 bits
        [rows, W]. A Future of that array, or None when no sequence has a grammar."""
        pairs = [(h.active, i) for i, s in enumerate(seqs) if s.sample and s.sampling.structured
                 and (h := self.histories.get(s.seq_id)) is not None and h.active is not None]
        if not pairs:
            return None
        import llguidance
        import llguidance.numpy
        if self.mask_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self.mask_pool, self.grammar_executor = ThreadPoolExecutor(1), llguidance.LLExecutor()
        mask = np.full((len(seqs), -(-self.cfg.vocab_size // 32)), -1, np.int32)

        def fill():
            llguidance.numpy.fill_next_token_bitmask_par(self.grammar_executor, pairs, mask)
            return mask
        return self.mask_pool.submit(fill)

    def step(self, seqs: list[SeqStep] | DecodeStep | DecodeChain, is_prefill: bool, logprobs: bool = True,
             released=(), hidden: np.ndarray | None = None, sampled: dict | None = None) -> StepOutput | list:
        """Runs the step (SeqSteps, or a DecodeStep: worker.protocol) and samples; a DecodeChain's
        steps give a StepOutput each (`chain`). Every rank of a
        group samples the same tokens (the device sampler's collectives give each the same figures)
        and keeps them for the next step's SAMPLED inputs, and in the histories of sequences whose
        sampling looks back (until `released`).
        A pipeline stage (EngineConfig.pipeline) takes the stage before's hidden states of the
        step's tokens (`hidden`); one but the last returns its own (StepOutput.hidden) and samples
        nothing. The last stage samples, and the first takes the tokens the last sampled for the
        sequences of its SAMPLED inputs (`sampled`: seq_id -> token)."""
        if isinstance(seqs, DecodeChain):
            return self.chain(seqs, logprobs, released)
        t0, bytes0 = time.perf_counter(), self.host_bytes
        stage = self.stage
        seqs = self.steps.read(seqs, released)
        for seq_id in released:
            self.histories.pop(seq_id, None)
            if stage.count > 1:
                self.sampled.pop(seq_id, None)
        if sampled:
            self.sampled.update(sampled)
        for s in seqs:
            self.feed_sampled(s)
            if s.history is not None and stage.last:
                matcher = self.grammar(s.sampling.structured) if s.sampling.structured else None
                self.histories[s.seq_id] = sampler.History(*s.history, matcher, s.sampling.structured_after)
        chosen, lps, scores, model_s, rows, at = [], [], [], 0.0, [], 0
        for part in self.parts(seqs, is_prefill):
            t1 = time.perf_counter()
            n = sum(len(s.token_ids) for s in part)
            h = None if hidden is None else hidden[at: at + n]
            at += n
            if not stage.last:
                out, _, _ = self.network(part, is_prefill, hidden=h)
                rows.append(self.to_host(out, n))
                model_s += self.synced - t1
                continue
            masks = self.start_masks(part)
            logits, greedy, part_scores = self.network(part, is_prefill, hidden=h)
            tokens, part_lps = self.sample(part, logits, greedy, logprobs, masks)
            if self.synced < t1:                 # nothing copied (no sequence samples or scores): wait for it
                self.ms.runtime.synchronize()
                self.synced = time.perf_counter()
            model_s += self.synced - t1          # the network and the device sampler, to their last copy
            chosen += tokens
            lps += part_lps
            scores += part_scores or [None] * len(part)
        self.model_s += model_s
        if not stage.last:
            return StepOutput([], worker_s=time.perf_counter() - t0, model_s=model_s,
                              host_bytes=self.host_bytes - bytes0, hidden=np.concatenate(rows))
        self.sampled = {s.seq_id: t for s, t in zip(seqs, chosen) if s.sample}
        for s, t in zip(seqs, chosen):
            if s.sample and (h := self.histories.get(s.seq_id)) is not None:
                h.add(t)
        return StepOutput(chosen, lps if any(x is not None for x in lps) else None,
                          None if all(x is None for x in scores) else scores, time.perf_counter() - t0, model_s,
                          self.host_bytes - bytes0, sampled=self.sampled if stage.count > 1 else None)

    def feed_sampled(self, s: SeqStep) -> None:
        """A step's SAMPLED token (worker.protocol) as the token this rank's step before picked for
        its sequence (a pipeline stage but the first feeds hidden states: 0, unread)."""
        if s.token_ids != [SAMPLED]:
            return
        if not self.stage.first:
            s.token_ids = [0]
        elif s.seq_id not in self.sampled:
            raise ValueError(f"sequence {s.seq_id}: the step before sampled no token for it")
        else:
            s.token_ids = [self.sampled.pop(s.seq_id) if self.stage.count > 1 else self.sampled[s.seq_id]]

    def chainable(self, chain: DecodeChain) -> bool:
        """Whether `chain`'s steps can run as one call of `decode_chain`: this runner has it, and
        every step is the one before it a token further for the same sequences, fed the tokens it
        picks (SAMPLED), no sequence with anything that changes its logits or asks for
        log-probabilities (those sample on the host's terms: `sample`); a sequence that draws
        (temperature > 0) where one SampleRows call draws a step (`samples_in_chains`)."""
        steps, last = chain.steps, self.steps.last
        if len(steps) < 2 or chain.one_by_one or "chain" not in self.fns:
            return False
        first = steps[0]
        for k, st in enumerate(steps[1:], 1):
            if (st.seq_ids != first.seq_ids or any(t != SAMPLED for t in st.token_ids)
                    or any(c != c0 + k for c, c0 in zip(st.num_cached, first.num_cached))
                    or any(g != g0 + k for g, g0 in zip(st.num_generated, first.num_generated))):
                return False
        for seq_id in first.seq_ids:
            before = last.get(seq_id)
            if before is None or not chains(before.sampling, self.samples_in_chains(before.sampling)):
                return False
        return True

    def samples_in_chains(self, params) -> bool:
        """Whether a chain's steps draw a sequence of these sampling parameters on the device as
        `sample` would: at tp 1 with the CPU kernels, one SampleRows call a step of CANDIDATES
        candidates (the model's own VocabSampler's), the variant `sample` takes for top_k up to it."""
        return self.tp.size == 1 and self.dev.sampler_kernels is not None and params.top_k <= CANDIDATES

    def chain_draws(self, seqs: list[SeqStep], K: int, M: int) -> np.ndarray:
        """decode_chain's `draws`: [K, 1, 1] where every sequence is greedy; else [K, M, 5] float32,
        each step's row of each sequence as `sample` builds it (temperature, top_k, top_p, min_p,
        its uniform for its tokens generated by then: worker.device_sampler.uniforms), the padding
        rows greedy."""
        params = [s.sampling for s in seqs]
        if all(p.greedy for p in params):
            return np.zeros((K, 1, 1), np.float32)
        generated, rows = np.array([s.num_generated for s in seqs]), range(len(seqs))
        return np.stack([np.stack(draw_parameters(params, generated + k, rows, M), -1, dtype=np.float32)
                         for k in range(K)])

    def chain(self, chain: DecodeChain, logprobs: bool = True, released=()) -> list[StepOutput]:
        """The steps of a DecodeChain, a StepOutput each: as one call of the model's `decode_chain`
        where they can (`chainable`), which returns every step's tokens at once; else one step at
        a time. The tokens are those the steps one at a time pick (the same graph's operators, fed
        the same tokens, drawn with the same uniforms)."""
        if not self.chainable(chain):
            return one_by_one(self.step, chain, logprobs, released)
        t0, bytes0 = time.perf_counter(), self.host_bytes
        K = len(chain.steps)
        seqs = self.steps.read(chain.steps[0], released)
        for seq_id in released:
            self.histories.pop(seq_id, None)
        for s in seqs:
            self.feed_sampled(s)
        for st in chain.steps[1:]:
            later = self.steps.read(st)     # (their block tables: the last step's hold every token)
        rows = [SeqStep(s.seq_id, s.token_ids, s.num_cached, t.block_table) for s, t in zip(seqs, later)]
        inputs, _ = self.prepare(rows, False, chain=K)
        draws = self.ms.Tensor.from_numpy(self.chain_draws(seqs, K, inputs["out_index"].shape[0]))
        t1 = time.perf_counter()
        tokens = self.to_host(self._call("chain", inputs, draws))[:, :len(seqs)]
        model_s = self.synced - t1
        self.model_s += model_s
        self.sampled = {s.seq_id: int(t) for s, t in zip(seqs, tokens[-1])}
        share = (time.perf_counter() - t0) / K, model_s / K, (self.host_bytes - bytes0) // K
        return [StepOutput(row.tolist(), None, None, *share) for row in tokens]
