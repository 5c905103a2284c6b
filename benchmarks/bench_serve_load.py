"""Load on a running ``vllm serve --quantization neuron-w8`` (loopback only): requests/s and p50/p99 latency.

Many concurrent asyncio clients (httpx) send a mix of OpenAI completions and chat requests, streaming
and not, with mixed prompt lengths and ``max_tokens``, greedy (temperature 0, ``ignore_eos`` so every
answer has exactly ``max_tokens`` tokens). Every response is checked for well-formedness; the
benchmark prints one table row per phase and writes ``benchmarks/results/serve_load.json``.

The same module is the load driver of ``tests/test_load_server.py`` (which adds the determinism,
fault and memory checks), so the numbers and the test exercise one code path.

    .venv/bin/python benchmarks/bench_serve_load.py                 # tiny Qwen3-MoE FP8, 64 clients, 20 s
    .venv/bin/python benchmarks/bench_serve_load.py --model DIR --clients 128 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL_NAME = "tiny-moe"
WORDS = ("the quick brown fox jumps over a lazy dog while seven experts route every token through "
         "one byte weights on a small machine with two cores and a kv cache").split()


# ---- the server -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory of each process of the server's tree (API server, EngineCore, workers), by 'pid name'."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
        out = {}
        for p in procs:
            try:
                out[f"{p.pid} {' '.join(p.cmdline()[:3])[-60:]}"] = p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server's whole process tree."""
        return sum(self.rss_by_process().values())

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT the server's process group (it was started in its own session), then SIGKILL if needed."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout)
        return self.proc.returncode


def start_server(model: str, *, max_model_len: int = 512, max_num_seqs: int = 64, extra_args=(), env=None,
                 log_path: Path | None = None, quantization: str | None = "neuron-w8") -> Server:
    """``vllm serve MODEL --quantization neuron-w8`` on 127.0.0.1 and a free port (the vllm beside sys.executable).
    ``quantization=None`` serves an unquantised model (e.g. the exactly dequantised twin) for comparison."""
    port = free_port()
    exe = Path(sys.executable).with_name("vllm")
    log_path = log_path or Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    quant = ["--quantization", quantization] if quantization else []
    cmd = [str(exe), "serve", str(model), *quant, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL_NAME, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--enforce-eager", *extra_args]
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return Server(proc, port, log_path)


def wait_healthy(server: Server, timeout: float = 300.0) -> float:
    """Seconds until /health answers 200; raises RuntimeError (with the log tail) if the server dies or times out."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s:\n{server.log_tail()}")


# ---- requests -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """One request: endpoint kind, streaming, prompt and length (greedy, exactly ``max_tokens`` tokens)."""

    kind: str  # "completions" | "chat"
    stream: bool
    prompt: str
    max_tokens: int

    @property
    def key(self) -> tuple:
        """Requests with the same key must produce the same tokens (streaming does not change the maths)."""
        return (self.kind, self.prompt, self.max_tokens)


def make_specs(n: int, seed: int = 0) -> list[Spec]:
    """``n`` mixed requests built from 16 distinct prompts of 2..~120 words."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(length)) for length in
               (2, 3, 5, 8, 12, 16, 20, 24, 32, 40, 48, 60, 72, 88, 104, 120)]
    specs = []
    for i in range(n):
        specs.append(Spec(kind=("completions", "chat")[i % 2], stream=bool((i // 2) % 2), prompt=prompts[(i * 7) % len(prompts)],
                          max_tokens=(4, 8, 16, 24)[(i // 4) % 4]))
    return specs


def request_body(spec: Spec, logprobs: bool = False) -> dict:
    body = {"model": MODEL_NAME, "max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": spec.stream, "return_token_ids": True}
    if spec.kind == "completions":
        body["prompt"] = spec.prompt
        if logprobs:
            body["logprobs"] = 2
    else:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        if logprobs:
            body.update(logprobs=True, top_logprobs=2)
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Record:
    spec: Spec
    ok: bool
    latency: float
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""
    top_logprobs: list = field(default_factory=list)  # per position: {token_id_or_text: logprob} (reference runs)


def _check_choice(kind: str, choice: dict) -> str:
    if kind == "completions":
        if not isinstance(choice.get("text"), str):
            raise ValueError(f"choice without text: {choice}")
        return choice["text"]
    msg = choice.get("message") or {}
    if msg.get("role") != "assistant" or not isinstance(msg.get("content"), str):
        raise ValueError(f"chat choice without an assistant message: {choice}")
    return msg["content"]


def _logprob_rows(kind: str, choice: dict) -> list:
    lp = choice.get("logprobs") or {}
    if kind == "completions":
        return [dict(d or {}) for d in (lp.get("top_logprobs") or [])]
    return [{t["token"]: t["logprob"] for t in (c.get("top_logprobs") or [])} | {"__chosen__": c["logprob"]}
            for c in (lp.get("content") or [])]


async def send(client, base_url: str, spec: Spec, logprobs: bool = False) -> Record:
    """One request; the Record says whether the response was well-formed (and why not)."""
    url = f"{base_url}/v1/{'completions' if spec.kind == 'completions' else 'chat/completions'}"
    t0 = time.perf_counter()
    rec = Record(spec, ok=False, latency=0.0)
    try:
        if not spec.stream:
            resp = await client.post(url, json=request_body(spec, logprobs))
            rec.status = resp.status_code
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            data = resp.json()
            choice = data["choices"][0]
            rec.text = _check_choice(spec.kind, choice)
            rec.token_ids = list(choice.get("token_ids") or [])
            rec.top_logprobs = _logprob_rows(spec.kind, choice) if logprobs else []
            usage = data.get("usage") or {}
            finish = choice.get("finish_reason")
        else:
            usage, finish, done = {}, None, False
            async with client.stream("POST", url, json=request_body(spec, logprobs)) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    raise ValueError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        if line.strip():
                            raise ValueError(f"unexpected SSE line {line[:120]!r}")
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(payload)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        piece = choice.get("text") if spec.kind == "completions" else (choice.get("delta") or {}).get("content")
                        rec.text += piece or ""
                        rec.token_ids += list(choice.get("token_ids") or [])
                        finish = choice.get("finish_reason") or finish
            if not done:
                raise ValueError("stream ended without [DONE]")
        if finish != "length":
            raise ValueError(f"finish_reason {finish!r}, expected 'length' (ignore_eos)")
        if len(rec.token_ids) != spec.max_tokens or usage.get("completion_tokens") != spec.max_tokens:
            raise ValueError(f"{len(rec.token_ids)} token ids / usage {usage}, expected {spec.max_tokens} tokens")
        rec.ok = True
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, the caller judges
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.latency = time.perf_counter() - t0
    return rec


def new_client(clients: int):
    """One connection per request (no keep-alive): uvicorn closes a connection idle for 5 s
    (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a pooled connection reused at that moment fails with a ReadError
    that is the client's race, not the server's fault (seen on a starved 2-core machine). Retrying would hide
    real failures; not reusing connections removes the race. Loopback connects cost microseconds."""
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=clients + 32, max_keepalive_connections=0))


async def run_load(base_url: str, specs: list[Spec], clients: int, seconds: float | None = None) -> tuple[list[Record], float]:
    """``clients`` concurrent workers; each takes the next spec (cycling) until every spec was sent once
    (``seconds`` None) or until ``seconds`` have passed. Returns (records, wall seconds)."""
    records: list[Record] = []
    counter = iter(range(10**9))
    t0 = time.perf_counter()

    async with new_client(clients) as client:
        async def worker():
            while True:
                i = next(counter)
                if seconds is None and i >= len(specs):
                    return
                if seconds is not None and time.perf_counter() - t0 >= seconds:
                    return
                records.append(await send(client, base_url, specs[i % len(specs)]))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return records, time.perf_counter() - t0


async def run_sequential(base_url: str, specs: list[Spec], logprobs: bool = True) -> dict[tuple, Record]:
    """Each distinct request alone (non-streaming, with top-2 logprobs): the reference outputs."""
    out = {}
    async with new_client(1) as client:
        for spec in specs:
            if spec.key not in out:
                ref = Spec(spec.kind, False, spec.prompt, spec.max_tokens)
                out[spec.key] = await send(client, base_url, ref, logprobs=logprobs)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(name: str, records: list[Record], wall: float, clients: int) -> dict:
    lat = [r.latency for r in records if r.ok]
    tokens = sum(len(r.token_ids) for r in records if r.ok)
    return {"phase": name, "clients": clients, "requests": len(records), "failed": sum(not r.ok for r in records),
            "seconds": round(wall, 2), "req_per_s": len(records) / wall if wall else 0.0, "tokens_per_s": tokens / wall if wall else 0.0,
            "p50_ms": 1000 * percentile(lat, 50), "p99_ms": 1000 * percentile(lat, 99), "max_ms": 1000 * max(lat, default=float("nan"))}


# ---- the benchmark ---------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a tiny Qwen3-MoE FP8 written to a temp dir)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--dtype", default="auto", help="model dtype passed to vllm serve (auto: the checkpoint's, bf16)")
    ap.add_argument("--out", default="serve_load")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import print_table, write_json

    model = args.model
    if model is None:
        from vllm_moe_w8.tiny_models import write_checkpoint

        model = str(write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-serve-")) / "qwen3-moe", "qwen3-moe"))
    server = start_server(model, max_num_seqs=max(args.clients, 8), extra_args=("--dtype", args.dtype))
    rows = []
    try:
        startup = wait_healthy(server)
        specs = make_specs(4 * args.clients)
        warm, warm_wall = asyncio.run(run_load(server.base_url, specs, args.clients))
        rows.append(summarize("warm-up (each spec once)", warm, warm_wall, args.clients))
        one, one_wall = asyncio.run(run_load(server.base_url, specs[:32], 1))
        rows.append(summarize("one client", one, one_wall, 1))
        rss_before = server.rss_bytes()
        load, wall = asyncio.run(run_load(server.base_url, specs, args.clients, seconds=args.seconds))
        rss_after = server.rss_bytes()
        rows.append(summarize(f"{args.clients} clients, {args.seconds:.0f} s", load, wall, args.clients))
    finally:
        server.stop()
    print(f"vllm serve --quantization neuron-w8 --dtype {args.dtype}, model {model}: healthy after {startup:.1f} s; "
          f"server RSS {rss_before / 2**20:.0f} MiB -> {rss_after / 2**20:.0f} MiB over {len(load)} requests")
    print_table(rows, ["phase", "clients", "requests", "failed", "seconds", "req_per_s", "tokens_per_s", "p50_ms", "p99_ms", "max_ms"])
    errors = sorted({r.error for r in warm + one + load if not r.ok})[:5]
    for e in errors:
        print("error:", e)
    write_json(args.out, {"model": model, "dtype": args.dtype, "clients": args.clients, "startup_s": startup, "rss_before": rss_before, "rss_after": rss_after,
                          "rows": rows, "errors": errors})
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
