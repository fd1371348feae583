"""Shared by the server tests: one real-model server and one offline LLM of the same engine
config per pytest process (loading SmolLM2 twice per module would cost CI minutes), SSE and
/metrics helpers, and a tiny dummy-weight model for fault tests."""

from __future__ import annotations

import atexit
import functools
import json

import httpx

# Small KV budget (24 pages x 16 = 384 tokens) with 16 running requests: 64 concurrent requests
# of 10-60 tokens must preempt. max_model_len 256 keeps single requests servable.
BUNDLED = dict(model="smollm2-135m", device="cpu", num_pages=24, page_size=16, max_num_seqs=16,
               max_model_len=256)
MODEL = "smollm2-135m"


@functools.lru_cache(maxsize=None)
def bundled_server():
    from kvfit.config import make_config
    from kvfit.server.launch import BackgroundServer, engine_launch_kwargs

    cfg = make_config(**BUNDLED)
    # the engine in its own process, as `kvfit serve` runs it (the fault tests use a thread)
    srv = BackgroundServer(served_model_name=MODEL, **engine_launch_kwargs(cfg)).start()
    atexit.register(srv.stop)
    return srv


@functools.lru_cache(maxsize=None)
def offline_llm():
    from kvfit.llm import LLM

    return LLM(**BUNDLED)


def offline_greedy(prompts, max_tokens) -> list[str]:
    """Offline greedy texts (one SamplingParams per prompt when max_tokens is a list)."""
    from kvfit.sampling_params import SamplingParams

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    return [o.outputs[0].text for o in offline_llm().generate(prompts, params, use_tqdm=False)]


def metrics(base_url: str) -> dict[str, float]:
    """/metrics as {sample name (with labels): value}, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def sse_events(lines) -> list:
    """Parse SSE ``data:`` lines into JSON objects, with the string "[DONE]" kept as is."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
                  torch_dtype="float32", eos_token_id=255, bos_token_id=0)


def tiny_config(tmp_dir) -> str:
    """A config.json of a tiny Llama (served with --load-format dummy, token-id prompts)."""
    path = f"{tmp_dir}/config.json"
    with open(path, "w") as f:
        json.dump(TINY_LLAMA, f)
    return path


def tiny_engine_config(tmp_dir, **kw):
    """The fault tests' engine: the tiny Llama with dummy weights on CPU, 64 pages, 512 tokens."""
    from kvfit.config import make_config

    return make_config(**{**dict(model=tiny_config(tmp_dir), load_format="dummy", device="cpu",
                                 num_pages=64, max_model_len=512), **kw})


class ServerProcess:
    """``python -m kvfit.server.main`` on the tiny dummy-weight Llama (what ``kvfit serve``
    runs), this tree's ``src`` first on its path; ``extra`` flags appended. Entering waits until
    /health answers 200 (failing with the server's output if it exits first); leaving kills it
    if it still runs. ``proc`` (stdout and stderr merged into one pipe) and ``base`` (its URL)."""

    def __init__(self, tmp_dir, *extra: str, start_timeout: float = 120.0):
        import os
        import sys

        from kvfit.server.launch import free_port

        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "kvfit.server.main", "--model", tiny_config(tmp_dir),
                    "--load-format", "dummy", "--device", "cpu", "--num-pages", "64",
                    "--max-model-len", "512", "--port", str(port), "--log-level", "warning",
                    *extra]
        self.env = dict(os.environ)
        src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
        self.env["PYTHONPATH"] = src + os.pathsep + self.env.get("PYTHONPATH", "")
        self.start_timeout = start_timeout
        self.proc = None

    def __enter__(self) -> "ServerProcess":
        import subprocess
        import time

        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server did not answer /health within {self.start_timeout} s")

    def output(self) -> str:
        """What the server printed (once it has exited)."""
        return self.proc.stdout.read().decode(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stream_lines(url: str, body: dict, out: list, first) -> None:
    """POST a streaming request; append the status code then every non-empty SSE line to
    ``out`` (an ``httpx.HTTPError`` instead when the connection fails); set the
    ``threading.Event`` ``first`` at the first line and at the end (a thread's target)."""
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line:
                    out.append(line)
                    first.set()
    except httpx.HTTPError as e:
        out.append(e)
    first.set()


def start_stream(url: str, body: dict):
    """``stream_lines`` in a daemon thread: (thread, lines, first-line event)."""
    import threading

    lines, first = [], threading.Event()
    thread = threading.Thread(target=stream_lines, args=(url, {**body, "stream": True}, lines,
                                                         first), daemon=True)
    thread.start()
    return thread, lines, first


def stream_error(lines: list) -> dict:
    """The error object a stream ended with: the stream started (200), its last event is an
    ``error`` and it closed with ``[DONE]``."""
    assert lines[0] == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[-2][len("data: "):])["error"]
