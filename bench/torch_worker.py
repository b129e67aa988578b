"""PyTorch train steps in a child process: built and compiled as soon as it starts, timed on request.

``bench/gpu_evidence.py`` compiles its JAX steps and PyTorch's at the same time (a GPU host has
the cores; ``torch.compile`` takes 30-70 s a step) and then times every step alone, one after
the other. The worker speaks JSON lines on stdin/stdout (anything else it prints goes to
stderr):

* the parent's first line: the specs, ``[{"key", "kind": "bert" | "llama", "config": {...},
  "batch", "seq", "mode": "compile" | "eager", "attention_dropout"}]``;
* the worker builds each step, runs it once (compilation: ``first_step_s``) and warms it up,
  then answers ``{"ready": {key: {"name", "first_step_s"} | {"error"}}}``;
* each ``{"time": key, "n": n}`` is answered ``{"row": {...}}`` (``train_step.torch_time``'s
  fields and the name) or ``{"error"}``; end of input ends the worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 3


def _build(spec: dict):
    from bench import train_step
    from jaxaccel.models.architectures import BertConfig, LlamaConfig
    if spec["kind"] == "bert":
        return train_step.torch_bert_step(BertConfig(**spec["config"]), spec["batch"],
                                          spec["seq"], spec["mode"], spec["attention_dropout"])
    return train_step.torch_llama_step(LlamaConfig(**spec["config"]), spec["batch"],
                                       spec["seq"], spec["mode"])


def serve() -> None:
    """The child's side (``python bench/torch_worker.py``)."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                      # stray prints (ours, torch's) go to stderr
    sys.path.insert(0, ROOT)
    import torch
    from bench import train_step

    def say(msg):
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    specs = json.loads(sys.stdin.readline())
    steps, ready = {}, {}
    for spec in specs:
        try:
            step, name = _build(spec)
            t0 = time.perf_counter()
            for _ in range(1 + WARMUP):
                step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            steps[spec["key"]] = (step, name, spec)
            ready[spec["key"]] = {"name": name, "first_step_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 (reported to the parent, which goes on)
            ready[spec["key"]] = {"error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-2000:]}
    say({"ready": ready})
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            step, name, spec = steps[msg["time"]]
            row = train_step.torch_time(step, msg["n"], warmup=1, first=False)
            say({"row": {"name": name, "batch": spec["batch"], "seq": spec["seq"],
                         **row, "first_step_s": ready[msg["time"]]["first_step_s"]}})
        except Exception as e:  # noqa: BLE001
            say({"error": f"{type(e).__name__}: {e}"})


class TorchWorker:
    """The parent's side: ``TorchWorker(specs)`` starts the child (it compiles at once),
    ``ready()`` waits until every step is compiled, ``time(key, n)`` times one."""

    def __init__(self, specs: list[dict], env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.proc.stdin.write(json.dumps(specs) + "\n")
        self.proc.stdin.flush()
        self._ready = None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch worker exited (status {self.proc.wait()}); its "
                               "output is above")
        return json.loads(line)

    def ready(self) -> dict:
        if self._ready is None:
            self._ready = self._read()["ready"]
        return self._ready

    def time(self, key: str, n: int) -> dict:
        got = self.ready()[key]
        if "error" in got:
            raise RuntimeError(f"PyTorch step {key}: {got['error']}")
        self.proc.stdin.write(json.dumps({"time": key, "n": n}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(f"PyTorch step {key}: {answer['error']}")
        return answer["row"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


if __name__ == "__main__":
    serve()
