"""neuron_glue/tp_probe.py: a rank's slice of a checkpoint matrix cut by a module's own weight loader, run on index
probes. The truth is the loader itself: run on the real values (a torch tensor behind the same slice interface) it
must give exactly the probed rows and columns of the FP8 bytes; the 128x128 scale blocks follow, or the cut is refused.
The loaders here have the shapes of vllm-neuron's (sharded output dim stored transposed, row-parallel input dim,
replicated KV shards, [q | k | v] segments each sharded); in both trees the real ones are exercised by the mixer and
shared-expert tests."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_w8.neuron_glue import settings, tp_probe


class Loader:
    def __init__(self, transform):
        self.transform = transform

    def load(self, slices, rank):
        return self.transform(slices, rank).contiguous()


class TensorSlice:
    """A safetensors slice stand-in over real values (what the loader normally reads)."""

    def __init__(self, t):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, index):
        return self.t[index]


def column_parallel(size):  # shard of the output dim, stored [in, out]
    return Loader(lambda s, r: s[0][r * size:(r + 1) * size].T)


def row_parallel(size):  # shard of the input dim, stored [in, out]
    return Loader(lambda s, r: s[0][:, r * size:(r + 1) * size].T)


def segments(sizes, shards):  # each segment of the output dim sharded on its own, then concatenated, stored [in, out]
    def t(s, r):
        parts, off = [], 0
        for n in sizes:
            per = n // shards
            parts.append(s[0][off + r * per: off + (r + 1) * per])
            off += n
        return torch.cat(parts).T
    return Loader(t)


def bytes_and_scales(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.5
    return w, s


@pytest.mark.parametrize("loader, shape, rank", [
    (column_parallel(256), (1024, 256), 2), (row_parallel(128), (256, 512), 3),
    (Loader(lambda s, r: s[0][(r // 2) * 128:(r // 2 + 1) * 128].T), (256, 256), 3),  # replicated KV: shard rank // 2
    (segments((256, 256, 512), 2), (1024, 256), 1),
])
def test_probe_cut_equals_the_loaders_own_cut_of_the_values(loader, shape, rank):
    w, s = bytes_and_scales(*shape)
    c = tp_probe.cut(loader, shape, rank, "test")
    assert c.transposed
    codes, grid = torch.cat([tp_probe.take(w, s, c.rows[a:a + n], c.cols, "t")[0] for a, n in c.row_runs]), None
    assert torch.equal(codes, loader.load([TensorSlice(w)], rank).T)  # the loader on the real bytes
    # scales: each 128-block of the slice carries its checkpoint block's scale
    for a, n in c.row_runs:
        _, grid = tp_probe.take(w, s, c.rows[a:a + n], c.cols, "t")
        el = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[c.rows[a:a + n]][:, c.cols]
        assert torch.equal(grid.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :c.cols.numel()], el)


def test_runs_split_a_segmented_slice_and_not_a_contiguous_one():
    c = tp_probe.cut(segments((128, 128, 256), 2), (512, 128), 1, "t")
    assert c.row_runs == [(0, 64), (64, 64), (128, 128)]
    assert [int(c.rows[a]) for a, _ in c.row_runs] == [64, 192, 384]
    assert tp_probe.cut(column_parallel(128), (512, 128), 1, "t").row_runs == [(0, 128)]


def test_a_slice_inside_one_scale_block_is_kept_one_straddling_two_is_refused():
    w, s = bytes_and_scales(256, 128)
    inside = torch.arange(64, 128)  # the second half of block 0: block 0's scale
    assert torch.equal(tp_probe.take(w, s, inside, torch.arange(128), "t")[1], s[:1])
    with pytest.raises(ValueError, match=r"q_proj: this rank's rows 64\.\.191 cross a 128x128 scale block.*non_expert_layers"):
        tp_probe.take(w, s, torch.arange(64, 192), torch.arange(128), "q_proj")


def test_a_loader_that_is_not_a_row_column_selection_is_refused():
    flip = Loader(lambda s, r: s[0][:].flip(0).T)  # rows reversed: still a selection (rows 127 .. 0)
    assert int(tp_probe.cut(flip, (128, 128), 0, "t").rows[0]) == 127
    perm = torch.randperm(128 * 128, generator=torch.Generator().manual_seed(0))
    shuffle = Loader(lambda s, r: s[0][:].reshape(-1)[perm].reshape(128, 128))
    with pytest.raises(ValueError, match="mixes checkpoint rows or columns"):
        tp_probe.cut(shuffle, (128, 128), 0, "t")


def test_non_expert_layers_setting(monkeypatch):
    """additional_config > VLLM_MOE_W8_NON_EXPERT_LAYERS > "w8"; anything else refused naming both choices."""
    monkeypatch.delenv(settings.NON_EXPERT_ENV, raising=False)
    assert settings._non_expert_layers({}) == ("w8", "default")
    monkeypatch.setenv(settings.NON_EXPERT_ENV, "bf16")
    assert settings._non_expert_layers({}) == ("bf16", f"environment {settings.NON_EXPERT_ENV}")
    assert settings._non_expert_layers({"neuron_w8": {"non_expert_layers": "W8"}})[0] == "w8"
    with pytest.raises(ValueError, match=r"non_expert_layers 'fp8' \(from additional_config.*\"w8\".*\"bf16\""):
        settings._non_expert_layers({"neuron_w8": {"non_expert_layers": "fp8"}})
