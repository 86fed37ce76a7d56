"""Fixtures of the HTTP tests: compiled artifacts and `maxc serve` processes on loopback.

Run by cli/tests/serve.rs (part of `cargo test`), which sets MAXC_BIN (the maxc binary),
MAXC_FIXTURES (the reference fixtures) and MAXC_SMOLLM2 (the SmolLM2 GGUF).

With MAXC_MPIRUN set (a launcher command line, `mpirun --allow-run-as-root ...`: what
cli/tests/mpi_tp.rs sets), every artifact is compiled tensor-parallel (tiny-llama at degree 2,
SmolLM2's 9 heads at 3) and served as that many ranks under the launcher; the artifacts that
tensor parallelism cannot split (a draft role) are left out and their tests skipped.
"""

import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

MAXC = os.environ["MAXC_BIN"]
FIXTURES = os.environ["MAXC_FIXTURES"]
SMOLLM2 = os.environ["MAXC_SMOLLM2"]
MPIRUN = os.environ.get("MAXC_MPIRUN", "").split()


def tensor_parallel_degree(model):
    """The degree an artifact of `model` is compiled at under MAXC_MPIRUN (1 without)."""
    if not MPIRUN:
        return 1
    return 3 if model == SMOLLM2 else 2


def compile_artifact(model, out, *flags):
    degree = tensor_parallel_degree(model)
    if degree > 1:
        flags = (*flags, "--tensor-parallel-degree", str(degree))
    cmd = [MAXC, "compile", model, "--out", out, "--quiet", "--force", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return out


class Server:
    """A `maxc serve` process on 127.0.0.1 with free ports; stderr is collected."""

    def __init__(self, artifact, *flags, env=None):
        e = dict(os.environ)
        e.update(env or {})
        launch = []
        if MPIRUN:
            import json
            with open(os.path.join(artifact, "manifest.json")) as f:
                records = json.load(f).get("export_records", {})
            launch = [*MPIRUN, "-np", str(records.get("tp.degree", 1))]
        self.proc = subprocess.Popen(
            [*launch, MAXC, "serve", artifact, "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", "0", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=e)
        self.lines = []
        self._ready = threading.Event()
        self.base = self.metrics_url = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert self._ready.wait(60), "the server did not start: " + "".join(self.lines)
        assert self.base, "".join(self.lines)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.base + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("not healthy: " + "".join(self.lines))

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"API on (http://\S+), metrics on (http://\S+)", line)
            if m:
                self.base, self.metrics_url = m.group(1).rstrip(","), m.group(2)
                self._ready.set()
        self._ready.set()

    @property
    def v1(self):
        return self.base + "/v1"

    def metrics(self):
        """The Prometheus text parsed into {name{labels}: value}."""
        out = {}
        for line in httpx.get(self.metrics_url).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
        return out

    def metric(self, name):
        return self.metrics().get(name, 0.0)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return self.proc.returncode


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("artifacts")
    tiny = os.path.join(FIXTURES, "tiny-llama")
    return {
        "smol": compile_artifact(
            SMOLLM2, str(d / "smollm2.maxc"), "--max-seq-len", "512", "--page-size", "16",
            "--max-batch-size", "32", "--max-batch-input-tokens", "512"),
        "tiny_all": compile_artifact(
            tiny, str(d / "tiny-all.maxc"), "--all-logits", "--max-seq-len", "128",
            "--page-size", "16", "--max-batch-size", "8", "--max-batch-input-tokens", "256"),
        # Steps return at most 8 logit rows: prompts are scored in chunks of 8.
        "tiny_rows8": compile_artifact(
            tiny, str(d / "tiny-rows8.maxc"), "--max-logit-rows", "8", "--max-seq-len", "128",
            "--page-size", "16", "--max-batch-size", "8", "--max-batch-input-tokens", "256"),
        "tiny_small_kv": compile_artifact(
            tiny, str(d / "tiny-small.maxc"), "--max-seq-len", "128", "--page-size", "16",
            "--max-batch-size", "8", "--kv-cache-pages", "12"),
        "tiny": compile_artifact(
            tiny, str(d / "tiny.maxc"), "--max-seq-len", "128", "--page-size", "16",
            "--max-batch-size", "8"),
        # Tensor parallelism splits the decoder alone.
        "roles": None if MPIRUN else compile_artifact(
            os.path.join(FIXTURES, "tiny-roles"), str(d / "roles.maxc"), "--max-seq-len", "160",
            "--page-size", "16", "--max-batch-size", "8"),
    }


@pytest.fixture(scope="module")
def smol(artifacts):
    s = Server(artifacts["smol"])
    yield s
    s.stop()


def generate(artifact, prompt_tokens, max_new):
    """What `maxc generate` gives for a token prompt alone (ids and text)."""
    import json
    r = subprocess.run(
        [MAXC, "generate", artifact, "--tokens", ",".join(map(str, prompt_tokens)),
         "--max-new-tokens", str(max_new), "--json"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
