"""One ``vllm serve <tiny FP8 Qwen3-MoE> --quantization neuron-w8`` (127.0.0.1, a free port) under load and faults.

* 64 concurrent clients (completions + chat, streaming and not, mixed prompt lengths and max_tokens,
  greedy with ``ignore_eos``): zero failed requests, every response well-formed (benchmarks/bench_serve_load.py
  checks status, JSON/SSE framing, finish_reason, token counts), and every answer's token ids identical to
  the same request sent alone -- see TIE_LOGPROB_GAP for the only tolerated difference.
* Clients that disconnect mid-stream and malformed / oversized requests get 4xx (or are aborted) without
  disturbing concurrent well-formed requests; the server stays healthy and frees aborted requests.
* Resident memory of the server process tree after load + faults stays within RSS_GROWTH_BOUND of the
  value after warm-up.
The load driver is the benchmark's, so the reported req/s and p50/p99 come from the same code.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")
pytest.importorskip("psutil")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 64
LOAD_SECONDS = 15.0
# Greedy decoding of a random tiny model: logits are nearly flat. Measured in bf16 (the model's default dtype):
# concurrent answers left the sequential ones at positions whose top-2 logits were exactly one bf16 step
# apart (2**-5 at |logit| in [4, 8)): a batch of 64 runs the linear layers with other GEMM shapes than a
# batch of 1, and one bf16 rounding flips such ties. The server therefore runs in float32 (the plugin's
# op computes in fp32 either way), where batch-shape effects are ~1e-6; a concurrent answer may leave the
# sequential one only where the sequential run's best two candidates are closer than this; any other
# difference fails.
TIE_LOGPROB_GAP = 1e-3
# RSS: the server's worker process grows under load even without the plugin. Measured here (fp32, 64 clients,
# 10 s phases after warm-up): the exactly dequantised twin served by vLLM alone grew +63, +40, +25 MiB per phase,
# the same checkpoint with neuron-w8 +84, +48, +50 MiB (cause not identified; vLLM warns that its CPU
# worker wants libtcmalloc preloaded; the KV cache is not it: with 160 KV blocks, all touched in the warm-up, it still
# grows). So the bound is relative, measured side by side: over one more load phase of equal length, the
# neuron-w8 server may grow at most RSS_RATIO x the twin's growth + RSS_SLACK. A plugin leak of one
# retained [T, vocab] fp32 logits tensor per 100-token request (200 KiB x ~400 requests = 80 MiB) fails it.
SERVE_ARGS = ("--dtype", "float32", "--num-gpu-blocks-override", "160")
RSS_RATIO = 1.5
RSS_SLACK = 40 * 2**20
MIN_REQUESTS_FOR_RSS = 150
STARTUP_TIMEOUT_S = 420  # ~25 s idle; several times that on a 2-core machine shared with other jobs


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_serve_load", ROOT / "benchmarks" / "bench_serve_load.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve_load"] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    model = tiny_checkpoint("qwen3-moe")
    srv = bench.start_server(str(model), max_model_len=512, max_num_seqs=CLIENTS, extra_args=SERVE_ARGS,
                             log_path=tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        bench.wait_healthy(srv, timeout=STARTUP_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def run(server):
    specs = bench.make_specs(CLIENTS)
    warm, warm_wall = asyncio.run(bench.run_load(server.base_url, specs, CLIENTS))
    reference = asyncio.run(bench.run_sequential(server.base_url, specs))
    load, wall = asyncio.run(bench.run_load(server.base_url, specs, CLIENTS, seconds=LOAD_SECONDS))
    rss_load = server.rss_by_process()
    summary = bench.summarize(f"{CLIENTS} clients", load, wall, CLIENTS)
    print(f"\nload: {summary}")
    return {"specs": specs, "warm": warm, "reference": reference, "load": load, "summary": summary, "rss_load": rss_load}


def _divergence(rec, ref) -> str | None:
    """None if ``rec`` matches the sequential reference (or leaves it only at a near-tie), else why not."""
    if rec.token_ids == ref.token_ids:
        return None
    j = next((i for i, (a, b) in enumerate(zip(rec.token_ids, ref.token_ids)) if a != b), None)
    if j is None:
        return f"length {len(rec.token_ids)} vs {len(ref.token_ids)}"
    row = ref.top_logprobs[j] if j < len(ref.top_logprobs) else {}
    values = sorted((v for k, v in row.items() if k != "__chosen__"), reverse=True)
    if len(values) >= 2 and values[0] - values[1] < TIE_LOGPROB_GAP:
        return None
    return f"token {j}: {rec.token_ids[j]} vs {ref.token_ids[j]} (reference top-2 logprobs {values[:2]})"


def _tie_gap(rec, ref) -> float:
    j = next(i for i, (a, b) in enumerate(zip(rec.token_ids, ref.token_ids)) if a != b)
    values = sorted((v for k, v in ref.top_logprobs[j].items() if k != "__chosen__"), reverse=True)
    return values[0] - values[1]


def test_all_requests_succeed_and_are_well_formed(run):
    for phase in ("warm", "load"):
        bad = [(r.spec, r.error) for r in run[phase] if not r.ok]
        assert not bad, f"{len(bad)} failed {phase} requests, e.g. {bad[:3]}"
    assert all(r.ok for r in run["reference"].values())
    assert len(run["load"]) >= CLIENTS
    kinds = {(r.spec.kind, r.spec.stream) for r in run["load"]}
    assert kinds == {("completions", False), ("completions", True), ("chat", False), ("chat", True)}


def test_concurrent_greedy_outputs_equal_sequential_ones(run):
    ref = run["reference"]
    records = run["warm"] + run["load"]
    diffs = [(r.spec, d) for r in records if (d := _divergence(r, ref[r.spec.key]))]
    assert not diffs, f"{len(diffs)} of {len(records)} answers differ from the same request sent alone, e.g. {diffs[:3]}"
    exact = sum(r.token_ids == ref[r.spec.key].token_ids for r in records)
    ties = sorted({(r.spec.key, _tie_gap(r, ref[r.spec.key])) for r in records if r.token_ids != ref[r.spec.key].token_ids})
    print(f"\nnear-tie divergences (request, top-2 gap): {ties}")
    print(f"\n{exact} of {len(records)} concurrent answers token-identical to the sequential run; the rest left it at a near-tie")
    assert exact >= 0.9 * len(records)  # ties are rare: if not, the check would be vacuous


# ---- faults -------------------------------------------------------------------------------------------

async def _disconnect_mid_stream(base_url: str, n_chunks: int = 2) -> int:
    """Start a long streaming request, read a few chunks, hang up. Returns the chunks read."""
    body = {"model": bench.MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 400, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    got = 0
    async with httpx.AsyncClient(timeout=60.0) as client:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got >= n_chunks:
                        break  # leaving the context closes the connection mid-stream
    return got


def _bad_requests() -> list[tuple[str, str, dict | bytes | str]]:
    """(name, path, body) of requests the server must refuse with a 4xx."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    base = {"model": bench.MODEL_NAME, "max_tokens": 4}
    return [
        ("bad json", c, b'{"model": "tiny-moe", "prompt": "hi", '),
        ("not an object", c, b"[1, 2, 3]"),
        ("prompt longer than max_model_len", c, {**base, "prompt": "fox " * 2000}),
        ("oversized prompt (400 KB)", c, {**base, "prompt": "jumps over " * 40000}),
        ("negative max_tokens", c, {**base, "prompt": "hi", "max_tokens": -5}),
        ("unknown model", c, {**base, "model": "no-such-model", "prompt": "hi"}),
        ("missing prompt", c, {"model": bench.MODEL_NAME, "max_tokens": 4}),
        ("chat without messages", chat, {**base}),
        ("chat negative max_tokens", chat, {**base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}),
        ("temperature not a number", c, {**base, "prompt": "hi", "temperature": "hot"}),
    ]


async def _send_bad(base_url: str, name: str, path: str, body) -> tuple[str, int, str]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        if isinstance(body, (bytes, str)):
            resp = await client.post(base_url + path, content=body, headers={"content-type": "application/json"})
        else:
            resp = await client.post(base_url + path, json=body)
    return name, resp.status_code, resp.text[:300]


async def _faults_during_load(base_url: str, specs):
    good_task = asyncio.create_task(bench.run_load(base_url, specs, 32))
    await asyncio.sleep(0.5)  # the well-formed load is in flight
    disconnects = [_disconnect_mid_stream(base_url) for _ in range(8)]
    bad = [_send_bad(base_url, *b) for b in _bad_requests()]
    results = await asyncio.gather(*disconnects, *bad)
    good, _ = await good_task
    return results[:8], results[8:], good


def _running_requests(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5.0).text
    values = [float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$", text, re.M)]
    return sum(values)


def test_disconnects_and_bad_requests_do_not_disturb_others(server, run):
    specs = run["specs"]
    disconnects, bad, good = asyncio.run(_faults_during_load(server.base_url, specs))
    assert all(n >= 2 for n in disconnects)
    wrong = [(name, status, text) for name, status, text in bad if not 400 <= status < 500]
    assert not wrong, f"malformed requests not answered with 4xx: {wrong}"
    failed = [(r.spec, r.error) for r in good if not r.ok]
    assert not failed, f"well-formed requests failed next to the faults: {failed[:3]}"
    diffs = [(r.spec, d) for r in good if (d := _divergence(r, run["reference"][r.spec.key]))]
    assert not diffs, diffs[:3]
    assert httpx.get(f"{server.base_url}/health", timeout=5.0).status_code == 200
    # the hung-up streams were aborted, not left generating 400 tokens each
    deadline = time.monotonic() + 30
    while _running_requests(server.base_url) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running_requests(server.base_url) == 0
    after = asyncio.run(bench.run_load(server.base_url, specs[:8], 8))[0]
    assert all(r.ok for r in after)


def _one_more_phase(srv, specs) -> tuple[int, int]:
    """(RSS growth of the server tree, requests) over one more LOAD_SECONDS phase."""
    before = srv.rss_bytes()
    recs, _ = asyncio.run(bench.run_load(srv.base_url, specs, CLIENTS, seconds=LOAD_SECONDS))
    assert all(r.ok for r in recs), [r.error for r in recs if not r.ok][:3]
    return srv.rss_bytes() - before, len(recs)


def test_resident_memory_grows_no_more_than_vllm_alone(server, run, tiny_twin, tmp_path):
    """Runs last: one more load phase on the neuron-w8 server vs the same on its unquantised twin (no plugin)."""
    assert server.proc.poll() is None, server.log_tail()
    growth, n = _one_more_phase(server, run["specs"])
    twin = bench.start_server(str(tiny_twin("qwen3-moe")), max_model_len=512, max_num_seqs=CLIENTS, extra_args=SERVE_ARGS,
                              log_path=tmp_path / "twin.log", quantization=None)
    try:
        bench.wait_healthy(twin, timeout=STARTUP_TIMEOUT_S)
        asyncio.run(bench.run_load(twin.base_url, run["specs"], CLIENTS))  # warm-up, as for the plugin
        _one_more_phase(twin, run["specs"])  # first load phase, as in the fixture
        twin_growth, twin_n = _one_more_phase(twin, run["specs"])
    finally:
        twin.stop()
    print(f"\nRSS growth over one more {LOAD_SECONDS:.0f} s phase: neuron-w8 {growth / 2**20:.1f} MiB ({n} requests), "
          f"unquantised twin without the plugin {twin_growth / 2**20:.1f} MiB ({twin_n} requests)")
    assert n >= MIN_REQUESTS_FOR_RSS
    assert growth <= RSS_RATIO * max(twin_growth, 0) + RSS_SLACK, (growth, twin_growth)
