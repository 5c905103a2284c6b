"""Host entry points of the device-scheduled routed-expert kernels (selective decode, block prefill).

Launch contract (what ``neuron_glue.kernel_launch`` passes to ``wrap_nki(kernel)[lnc](*tensors, **consts)``):

* **device tensors** (positional, in this order; all made by traceable torch ops from the call's routing, on
  the routing's device - :func:`block_call`):
  ``hidden [T + B, H] bf16``, ``w13 [E, 128, H/128, 2I] uint8``, ``w13_scales [E, 2I/128, G13] f32``,
  ``w2 [E, 128, I/128, H] uint8``, ``w2_scales [E, H/128, G2] f32`` (the resident ``host.KernelWeights``),
  ``token_position_to_id [N, B] int32``, ``position_weight [N, B] f32``, ``position_store [N, B, 2] int32``,
  ``block_to_expert [N, 1] int32``, ``block_load_expert [N, 1] int32``, ``block_range [lnc, 2] int32``
  (kernels/routing.py documents each).
* **constants** (keyword, hashed into the compiled kernel; data-independent): ``swiglu_limit`` (float, the
  model's); pow2 also ``vector_blocks`` (int, the engine schedule ``kernels/schedule.py`` read from the Neuron
  calibration file at load, the dense kernel's) and ``stationary_weights`` (int 0/1, :func:`stationary_weights`:
  selective decode weights-stationary, kernels/weights_stationary.py - by the scenario's
  ``WEIGHTS_STATIONARY_MAX_TOKENS``, the bucket and the shape); ``split_inter`` (int 0/1, :func:`split_inter`: a
  function of the bucket T, B, LNC and I only). The kernel function (pow2 / output-block) follows ``kw.mode``.
* ``split_inter = 1`` (selective decode at LNC > 1: at bucket 1 whenever I / LNC is a multiple of 128, at larger
  buckets when it is a multiple of 512 - GLM-5.3-Flash TP=32 and GLM-5 at I = 2048 - :func:`split_inter`): program p
  computes every used block over its own I / LNC intermediate rows (gate and up rows [p I/n, (p+1) I/n), the down
  projection over them; each program loads the expert's whole scale rows, a few KiB) and writes that partial [T, H]
  into its slab; ``block_range`` gives every program all used blocks. Otherwise (LNC 1, block prefill, or the
  static fallback) the programs split the blocks - in block prefill where an expert's codes stay resident, at
  expert boundaries (:func:`aligned_shares`).
* sizes: ``B`` = :func:`block_rows` (T), ``N`` = ``routing.capacity_blocks(T, k, E, B)``: functions of the bucket
  (T, top_k, E), never of the routing values. One compile per (mode, T bucket).
* result ``[lnc, T, H] f32`` -> ``routing.combine(result, T, program_tokens)`` = the routed sum [T, H]
  (:func:`block_call` returns ``program_tokens [lnc, T] bool`` beside the launch: in block prefill at LNC > 1 the
  kernel writes only the slab rows of the tokens each program stores - no zero fill - and the sum selects each slab
  there; at LNC 1 the slab is zero-filled and in selective decode stored whole from its SBUF accumulator
  (``moe_w8_blocks.zero_fill``) and it is None).

Which schedule (:func:`schedule_for`): T <= ``SELECTIVE_MAX_TOKENS`` -> selective decode (B = T's bucket in
:data:`SELECTIVE_BUCKETS`, powers of two from 1: a T=1 call moves one token row, not 16; one block per routed local
expert); up to 128 tokens beyond it -> the all-expert dense kernel (kernels/moe_w8.py,
launched as today); larger T -> block prefill (B = 128; T padded by the caller to its length bucket).
``SELECTIVE_MAX_TOKENS`` comes from the cost model, per scenario: ``benchmarks/bench_nki_kernels.py --routed`` prices
both decode kernels per bucket (Qwen3.5-35B-A3B EP=8, GLM-5.3-Flash EP=32; results/bench_nki_routed_decode.json,
``selective_cheaper_up_to_by_scenario``: the largest decode bucket up to which selective is cheaper at both shapes).
With #21's dense dataflow the all-expert kernel wins from T = 64 (both scenarios, since the padding rows' scatter-add
is skipped; documented was T = 32 before) at Qwen3.5 width, where nearly every local expert is routed and the
selective kernel's per-block overheads (dynamic-loop iterations, metadata DMAs, gathered rows) are not repaid. The scenario is the one the Neuron calibration file names
(``kernels/schedule.py``, read once at load like the pow2 engine schedule; no file: fitted).
"""

from __future__ import annotations

import torch

from . import host, routing, weights_stationary
from .moe_w8 import POW2_SCHEDULE
from .moe_w8_blocks import SLAB, moe_w8_blocks_output_block, moe_w8_blocks_pow2, resident_weights, zero_fill
from .selective_decode import whole_share

P = 128
# bench_nki_routed_decode.json: selective_cheaper_up_to_by_scenario (tests/test_nki_routing.py checks they agree)
SELECTIVE_MAX_TOKENS_BY_SCENARIO = {"fitted": 64, "documented": 64}
SELECTIVE_MAX_TOKENS = SELECTIVE_MAX_TOKENS_BY_SCENARIO[POW2_SCHEDULE.scenario]
SPLIT_NARROW_MAX_TOKENS = 1  # selective decode splits I into shares narrower than 512 columns up to this bucket
SELECTIVE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # selective decode's token buckets (dense: host.T_BUCKETS)
# selective decode runs weights-stationary (kernels/weights_stationary.py) up to this bucket, per cost scenario
WEIGHTS_STATIONARY_MAX_TOKENS_BY_SCENARIO = {"fitted": 0, "documented": 16}
WEIGHTS_STATIONARY_MAX_TOKENS = WEIGHTS_STATIONARY_MAX_TOKENS_BY_SCENARIO[POW2_SCHEDULE.scenario]
BLOCKS = {"pow2": moe_w8_blocks_pow2, "output-block": moe_w8_blocks_output_block}
_DTYPES = {"hidden": "bfloat16", "token_position_to_id": "int32", "position_weight": "float32",
           "position_store": "int32", "block_to_expert": "int32", "block_load_expert": "int32", "block_range": "int32"}


def schedule_for(tokens: int) -> str:
    """'selective' | 'dense' | 'blocks' for a call of ``tokens`` tokens."""
    if tokens <= SELECTIVE_MAX_TOKENS:
        return "selective"
    return "dense" if tokens <= P else "blocks"


def selective_bucket(tokens: int) -> int:
    """The smallest of :data:`SELECTIVE_BUCKETS` holding ``tokens`` (selective decode pads T to it)."""
    for b in SELECTIVE_BUCKETS:
        if tokens <= b:
            return b
    raise ValueError(f"{tokens} tokens exceed selective decode's largest bucket {SELECTIVE_BUCKETS[-1]}")


def block_rows(tokens: int) -> int:
    """B: the selective decode bucket (:func:`selective_bucket`) for selective decode, 128 for prefill blocks."""
    return selective_bucket(tokens) if tokens <= SELECTIVE_MAX_TOKENS else P


def can_split_inter(tokens: int, block: int, programs: int, inter: int) -> bool:
    """Whether the block kernel can split each block's intermediate across the programs: selective decode (T <= B)
    at more than one program, I / programs a multiple of the 128-row scale tile."""
    return programs > 1 and tokens <= block and inter % (programs * P) == 0


def split_inter(tokens: int, block: int, programs: int, inter: int) -> bool:
    """Whether a launch splits the intermediate instead of the blocks (a static rule of the bucket, LNC and I, never
    of the routing), when it can: at bucket 1 always (a lone routed expert would leave a core idle: Qwen3.5-35B-A3B
    T=1 23.0 / 12.2 us split vs 30.6 / 19.4 us not, fitted / documented), else when each program's share is whole
    512-column slabs, so its gate and up matmuls stay as wide as unsplit (a 256-row share makes as many matmuls, half
    as wide: at Qwen3.5 width, T = 2..32, split is 4-40 % slower in both scenarios). Else the programs split the
    blocks. (Measured with the cost model, both scenarios, Qwen3.5 EP=8, GLM-5.3-Flash EP=32 / TP=64, GLM-5 EP64.)"""
    return can_split_inter(tokens, block, programs, inter) and (inter % (programs * SLAB) == 0
                                                                or tokens <= SPLIT_NARROW_MAX_TOKENS)


ALIGNED_MAX_EXPERTS = 16  # block prefill aligns the programs' shares to experts up to this many local experts


def aligned_shares(tokens: int, block: int, programs: int, hidden: int, inter: int, experts: int) -> bool:
    """Whether block prefill's programs take shares of the blocks that start at expert boundaries (a static rule of
    the bucket, LNC and shape, never of the routing): at LNC > 1 where an expert's codes stay resident across its
    blocks (``moe_w8_blocks.resident_weights``) and the local experts are few (<= :data:`ALIGNED_MAX_EXPERTS`), so
    the expert an equal split would cut - read by both programs, (LNC - 1) / E of the call's code bytes - is
    worth up to one expert's blocks of imbalance. Cost model, both scenarios: GLM-5.3-Flash EP=32 (9 local
    experts) at 8k reads 247 MB, 0.47x AWS's BF16 moe_cte (benchmarks/results/aws_moe.json), for 2.01 / 1.31 ms
    (streamed per block before: 474 MB, 1.81 / 1.26; AWS: 2.22 / 1.76); Qwen3.5-35B-A3B EP=8 (32 local experts)
    keeps equal shares: aligned, 8k at LNC 2 read 1.4 % fewer bytes and ran 2 % slower in both scenarios
    (bench_grouped_prefill)."""
    return tokens > block and programs > 1 and experts <= ALIGNED_MAX_EXPERTS and resident_weights(hidden, inter)


def stationary_weights(tokens: int, block: int, programs: int, hidden: int, inter: int, mode: str,
                       max_tokens: int | None = None) -> bool:
    """Whether selective decode runs weights-stationary (a static rule of the bucket, LNC and shape): pow2, T <= B and
    T <= ``max_tokens`` (default :data:`WEIGHTS_STATIONARY_MAX_TOKENS`, the scenario's), the program's share of an
    expert's codes in one piece and a block's partials in one PSUM bank."""
    limit = WEIGHTS_STATIONARY_MAX_TOKENS if max_tokens is None else max_tokens
    share = inter // programs if split_inter(tokens, block, programs, inter) else inter
    return (mode == "pow2" and tokens <= min(block, limit) and whole_share(hidden, share)
            and weights_stationary.fits(hidden, share, tokens))


def block_call(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kw: host.KernelWeights,
               programs: int, swiglu_limit: float = 0.0, block: int | None = None,
               weights_stationary_max: int | None = None):
    """(kernel, device tensors, constants, program_tokens) of one block-scheduled launch; traceable (no value read
    on the host). ``program_tokens`` [programs, T] bool is for ``routing.combine`` after the launch: the tokens each
    program's blocks store where the kernel writes no zero fill (block prefill at LNC > 1), None where it does.

    ``x`` [T, H] is the call's (bucket-padded) tokens; padded tokens carry no route (ids -1)."""
    tokens = x.shape[0]
    b = block or block_rows(tokens)
    split = split_inter(tokens, b, programs, kw.w13.shape[3] // 2)
    aligned = aligned_shares(tokens, b, programs, kw.hidden_size, kw.w13.shape[3] // 2, kw.num_experts)
    sched = routing.block_schedule(topk_weights, topk_ids, kw.num_experts, b, programs, split, aligned)
    tensors = (routing.padded_hidden(x, b), kw.w13, kw.w13_scales, kw.w2, kw.w2_scales) + sched.tensors()
    consts = {"swiglu_limit": float(swiglu_limit)}
    if kw.mode == "pow2":
        consts["vector_blocks"] = POW2_SCHEDULE.vector_blocks
        consts["stationary_weights"] = int(stationary_weights(tokens, b, programs, kw.hidden_size,
                                                              kw.w13.shape[3] // 2, kw.mode, weights_stationary_max))
    consts["split_inter"] = int(split)
    stored = None if zero_fill(programs, tokens, b) else sched.program_tokens  # a zero-filled slab is whole
    return BLOCKS[kw.mode], tensors, consts, stored


def check_block_args(tensors: tuple, consts: dict, mode: str, programs: int, tokens: int, top_k: int) -> None:
    """The block kernels' launch contract (shapes, dtypes, scale grids), checked before every launch; static
    properties only, so it is trace-safe. ValueError naming the tensor otherwise."""
    hidden, w13, w13_scales, w2, w2_scales, t2i, pw, store, b2e, load, br = tensors
    if len(hidden.shape) != 2:
        raise ValueError(f"moe_w8 block kernel: hidden must be [T + B, H], got {tuple(hidden.shape)}")
    e = host._check_expert_shapes(hidden.shape[1], w13, w2)
    host._check_scale_grids(hidden.shape[1], w13, w13_scales, w2_scales, mode, consts.get("swiglu_limit", 0.0))
    n, b = t2i.shape if len(t2i.shape) == 2 else (-1, -1)
    if not 1 <= b <= P:
        raise ValueError(f"moe_w8 block kernel: token_position_to_id {tuple(t2i.shape)} must be [N, B] with B <= 128")
    want = {"hidden": (tokens + b, hidden.shape[1]), "token_position_to_id": (routing.capacity_blocks(tokens, top_k, e, b), b),
            "position_weight": (n, b), "position_store": (n, b, 2), "block_to_expert": (n, 1),
            "block_load_expert": (n, 1), "block_range": (programs, 2)}
    inter = w13.shape[3] // 2
    split = consts.get("split_inter", 0)
    if split and not can_split_inter(tokens, b, programs, inter):
        raise ValueError(f"moe_w8 block kernel: split_inter=1 needs selective decode (T={tokens} <= B={b}) at LNC > 1 "
                         f"(got {programs}) and I={inter} a multiple of {programs} x 128; pass "
                         "host_routed.split_inter(T, B, LNC, I)")
    share = inter // programs if split else inter
    h = hidden.shape[1]
    allowed = mode == "pow2" and tokens <= b and whole_share(h, share) and weights_stationary.fits(h, share, tokens)
    if consts.get("stationary_weights", 0) and not allowed:
        raise ValueError(f"moe_w8 block kernel: stationary_weights=1 needs pow2 (got {mode}) selective decode "
                         f"(T={tokens} <= B={b}), a share of I={share} rows whose codes fit one SBUF piece and "
                         "H/128 x T, I/128 x T <= 512 (one PSUM bank); pass host_routed.stationary_weights(T, B, LNC, "
                         "H, I, mode)")
    for name, t in zip(_DTYPES, (hidden, t2i, pw, store, b2e, load, br)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"moe_w8 block kernel: {name} has shape {tuple(t.shape)}; expected {want[name]} "
                             f"(T={tokens}, top_k={top_k}, E={e}, B={b}; build it with routing.block_schedule)")
        if host._dtype_name(t) != _DTYPES[name]:
            raise ValueError(f"moe_w8 block kernel: {name} has dtype {t.dtype}; expected {_DTYPES[name]}")


def specialisation(kernel, tensors: tuple, consts: dict) -> tuple:
    """What a compile is keyed on: the kernel, every tensor's shape and dtype, the constants (wrap_nki hashes these)."""
    return (kernel.__name__,) + tuple((tuple(t.shape), str(t.dtype)) for t in tensors) + tuple(sorted(consts.items()))
