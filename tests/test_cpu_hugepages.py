"""vllm_moe_w8.op.hugepages: the op backs the resident expert codes with 2 MiB pages once, without changing a byte
or a result, says what it did, and can be switched off."""

from __future__ import annotations

import pytest
import torch

from test_cpu_moe import HOST_ISAS, make_experts, make_routing
from vllm_moe_w8.op import cpu as cpu_moe
from vllm_moe_w8.op import hugepages

THP = hugepages.thp_mode() in ("always", "madvise")


@pytest.fixture(autouse=True)
def _fresh():
    hugepages.reset()
    yield
    hugepages.reset()


def test_aligned_span_is_the_whole_pages_inside():
    mib2 = hugepages.HUGE
    assert hugepages.aligned_span(mib2 * 3 + 64, mib2 * 5) == (mib2 * 4, mib2 * 8)
    assert hugepages.aligned_span(mib2 + 1, mib2) == (mib2 * 2, mib2 * 2)  # no whole page: empty


@pytest.mark.skipif(not THP, reason="transparent huge pages disabled on this host")
def test_collapse_maps_the_codes_in_huge_pages_and_keeps_them():
    codes = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    copy = codes.clone()
    before = hugepages.huge_bytes_of_process()
    got = hugepages.ensure(codes, mode="collapse")
    if "MADV_COLLAPSE failed" in got:
        pytest.skip(f"this kernel cannot collapse now: {got}")
    assert got.startswith("collapsed"), got
    assert hugepages.huge_bytes_of_process() - before >= 16 << 20  # >= 8 of the ~11 whole pages inside 24 MiB
    assert torch.equal(codes, copy)
    assert hugepages.ensure(codes) == got and hugepages.status()["tensors"] == 1  # once per tensor


def test_off_small_and_strided_tensors_are_left_alone(monkeypatch):
    big = torch.zeros(8 << 20, dtype=torch.uint8)
    assert hugepages.ensure(big, mode="off").startswith("off")
    assert hugepages.ensure(torch.zeros(100, dtype=torch.uint8), mode="collapse").startswith(("too small", "not available"))
    assert hugepages.ensure(big[::2], mode="collapse").startswith("not applicable")
    assert hugepages.status()["tensors"] == 0
    monkeypatch.setenv(hugepages.ENV, "huge")
    with pytest.raises(ValueError, match=hugepages.ENV):
        hugepages.choice()


@pytest.mark.skipif("avx512bf16" not in HOST_ISAS and "avx2" not in HOST_ISAS, reason="needs a native kernel")
def test_op_results_do_not_depend_on_the_pages(monkeypatch, caplog):
    """The op on codes it collapsed and on a copy it left in 4 KiB pages: the same bits; the log names the setting."""
    e, h, inter = 8, 2048, 512  # 3 MB per expert: whole 2 MiB pages inside
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, (128, 128), "e4m3", seed=3)
    small = (w13.clone(), w2.clone())
    for codes in small:
        hugepages.ensure(codes, mode="off")
    gen = torch.Generator().manual_seed(4)
    ids, wts = make_routing(3, 4, e, gen)
    x = torch.randn((3, h), generator=gen).bfloat16()
    cpu_moe._LOGGED.clear()
    with caplog.at_level("INFO", logger="vllm.vllm_moe_w8.op.cpu"):
        out = cpu_moe.fused_moe_cpu(x, wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3")
    assert torch.equal(out, cpu_moe.fused_moe_cpu(x, wts, ids, small[0], w13_s, small[1], w2_s, 128, 128, "e4m3"))
    assert any("2 MiB pages" in r.getMessage() and hugepages.ENV in r.getMessage() for r in caplog.records)
    if THP:
        assert hugepages.status()["tensors"] == 2 and hugepages.status()["bytes"] > 0
