"""SPMD launch grids in the NKI interpreter: ``kernel[n]`` runs n programs (one per logical core) with their
own on-chip memory and shared HBM, ``nl.program_id`` tells them apart, and a grid that disagrees with the
runtime's LNC is refused. The dense MoE kernel splits its experts across the programs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_moe_w8.kernels import host, nki_cpu
from vllm_moe_w8.kernels.moe_w8 import moe_w8_pow2
from vllm_moe_w8.kernels.nki_api import BACKEND
from vllm_moe_w8.kernels.nki_cpu import NkiValidationError
from vllm_moe_w8.kernels.nki_cpu import isa as nisa
from vllm_moe_w8.kernels.nki_cpu import language as nl

# Two programs' partial sums (2 experts each) added vs 4 experts accumulated in one program: the same fp32
# terms added in another order, a few roundings of the output's magnitude apart.
REORDER_EPS = 8 * np.finfo(np.float32).eps

pytestmark = pytest.mark.skipif(BACKEND != "interpreter", reason="checks the project's interpreter (real NKI is installed)")


@nki_cpu.jit
def halves(a):
    """Each program copies its half of the rows of ``a`` (times program_id + 1) into the shared output."""
    n, pid = nl.num_programs(axes=0), nl.program_id(axis=0)
    rows = a.shape[0] // n
    out = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((rows, a.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[pid * rows:(pid + 1) * rows, :])
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=float(pid + 1))
    nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows, :], src=t)
    return out


def test_each_program_writes_its_share_of_the_shared_output():
    a = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    out, stats = nki_cpu.launch(halves, (2,), a, lnc=2)
    assert np.array_equal(out, np.concatenate([a[:4], 2 * a[4:]]))  # program 1 scaled its rows by 2
    assert len(stats) == 2 and all(s.hbm_read_bytes == a.nbytes // 2 for s in stats)
    assert np.array_equal(halves[1](a), a)  # one program does all rows


def test_programs_have_their_own_sbuf():
    @nki_cpu.jit
    def big(a):
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        keep = nl.ndarray((128, 150 * 1024 // 4), dtype=nl.float32, buffer=nl.sbuf)  # 150 KiB per partition
        nisa.memset(dst=keep, value=1.0)
        nisa.dma_copy(dst=out, src=keep[0:1, 0:1])
        return out

    out, stats = nki_cpu.launch(big, (2,), np.zeros(1, np.float32), lnc=2)  # 2 x 150 KiB would overflow one core
    assert out[0, 0] == 1.0 and [s.peak_sbuf_bytes for s in stats] == [150 * 1024] * 2


def test_a_grid_that_disagrees_with_the_lnc_is_refused():
    a = np.zeros((8, 4), np.float32)
    with pytest.raises(NkiValidationError, match=r"grid \[1\] under LNC=2.*kernel\[2\]"):
        nki_cpu.launch(halves, (1,), a, lnc=2)
    with pytest.raises(NkiValidationError, match=r"grid \[2\] under LNC=1"):
        nki_cpu.launch(halves, (2,), a, lnc=1)
    with pytest.raises(NkiValidationError, match="1-D grids"):
        nki_cpu.launch(halves, (2, 1), a)


def test_program_id_outside_a_kernel_and_unequal_shared_outputs_are_refused():
    with pytest.raises(NkiValidationError, match="only inside a kernel"):
        nl.program_id(0)

    @nki_cpu.jit
    def uneven(a):
        out = nl.ndarray((4 + nl.program_id(axis=0), 4), dtype=nl.float32, buffer=nl.shared_hbm)
        return out

    with pytest.raises(NkiValidationError, match="allocate their shared outputs identically"):
        nki_cpu.launch(uneven, (2,), np.zeros(1, np.float32))


def test_dense_kernel_splits_experts_across_programs():
    """Under LNC=2 each program reads only its half of the experts' bytes and the partials add to the
    one-program result (fp32 sums in another order: within a few fp32 ulps of the output's scale)."""
    gen = torch.Generator().manual_seed(0)
    e, h, i, t = 4, 256, 128, 16
    w13 = torch.randint(0, 0x78, (e, 2 * i, h), generator=gen, dtype=torch.uint8)
    w2 = torch.randint(0, 0x78, (e, h, i), generator=gen, dtype=torch.uint8)
    kw = host.to_kernel_layout(w13, torch.full((e, 2, 2), 1e-3), w2, torch.full((e, 2, 1), 1e-3), 128, 128, "e4m3")
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    aff = torch.rand(t, e, generator=gen)
    from vllm_moe_w8.kernels.launch import kernel_args

    args = kernel_args(x, aff, kw)
    one, (st1,) = nki_cpu.launch(moe_w8_pow2, (1,), *args, lnc=1)
    two, st2 = nki_cpu.launch(moe_w8_pow2, (2,), *args, lnc=2)
    assert one.shape == (1, t, h) and two.shape == (2, t, h)
    per_expert = (kw.w13[0].numel() + kw.w2[0].numel())
    io = x.numel() * 2 + aff.numel() * 4
    for s in st2:
        assert s.hbm_read_bytes - io - 4 * (kw.w13_scales[:2].numel() + kw.w2_scales[:2].numel()) == 2 * per_expert
    total = two.sum(axis=0)
    assert np.abs(total - one[0]).max() <= REORDER_EPS * np.abs(one[0]).max()
    assert not np.array_equal(two[0], two[1])  # both programs did work


@pytest.mark.parametrize("mode", ["pow2", "output-block"])
def test_dense_kernel_splits_the_intermediate_when_experts_do_not_divide(mode, monkeypatch):
    """3 experts at LNC=2 (I = 1024: 512 rows a program, moe_w8.split_inter): every program takes every expert over
    its half of I - half of every expert's codes each - and the partials' sum passes neuron-check's gate; its fault
    twin, both programs on the first half (the second never computed, the first counted twice), fails it."""
    from vllm_moe_w8.kernels import moe_w8
    from vllm_moe_w8.kernels.launch import KERNELS, kernel_args
    from vllm_moe_w8.neuron_glue import kernel_check as kc

    w13, s13, w2, s2, block = kc.repacked(kc.checkpoint_experts(3, 512, 1024, seed=4), mode)
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    assert moe_w8.split_inter(3, 2, 1024) and not moe_w8.split_inter(4, 2, 1024) and not moe_w8.split_inter(3, 2, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    tw, ti = kc.routing(5, 3, 2, seed=5)
    hidden, aff = host.pad_rows(x, 16), host.pad_rows(host.dense_affinities(tw, ti, 3), 16)
    ref = kc.reference_moe(x, tw, ti, w13, s13, w2, s2, *block, "e4m3")
    bound = kc.error_bound(x, tw, ti, w13, s13, w2, s2, block)

    def run():
        out, stats = nki_cpu.launch(KERNELS[mode], (2,), *kernel_args(hidden, aff, kw), lnc=2)
        return torch.from_numpy(np.asarray(out)).sum(dim=0)[:5], stats

    out, stats = run()
    codes = kw.w13.numel() + kw.w2.numel()
    for s in stats:  # half of every expert's codes, the scales and the tokens
        assert codes // 2 <= s.hbm_read_bytes <= codes // 2 + 4 * (kw.w13_scales.numel() + kw.w2_scales.numel()) + \
            hidden.numel() * 2 + aff.numel() * 4
    assert kc.within_bound(out, ref, bound)[0]
    monkeypatch.setattr(moe_w8, "inter_start", lambda pid, rows: 0)  # FAULT: both programs on rows [0, I/2)
    assert not kc.within_bound(run()[0], ref, bound)[0]
