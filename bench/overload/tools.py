"""The third-party programs of the overload benchmark, each in its own venv, and the systems it compares.

aiperf and LiteLLM do not resolve beside kvctl (nor beside each other), so each is installed into a venv of its own
under ``$XDG_CACHE_HOME/kvctl/bench/``, from ``requirements-<name>.txt`` (every package pinned, with hashes; pip
runs with ``--require-hashes``). A venv is keyed by the hash of its requirement file's pins: a new pin makes a new venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.common import server
from testkit.llama import free_port
from testkit.stack import spawn_group, start_stack, stop_group

HERE = Path(__file__).resolve().parent
MODEL_NAME = "smollm2"  # the name clients ask for; llama-server serves whatever it loaded under any name


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvctl" / "bench"


def tool_venv(name: str) -> Path:
    """The venv of ``name`` (``aiperf`` or ``litellm``), installed on first use; its path."""
    req = HERE / f"requirements-{name}.txt"
    pins = "".join(line for line in req.read_text().splitlines(keepends=True) if not line.startswith("#"))
    key = hashlib.sha256(pins.encode()).hexdigest()[:12]
    venv = cache_dir() / f"{name}-{key}"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two benchmarks at once install it once
        if (venv / ".installed").exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        print(f"overload: installing {name} into {venv} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--require-hashes", "--no-deps", "-r", str(req)], check=True)
        (venv / ".installed").write_text(req.name + "\n")
        return venv


def tool_version(venv: Path, package: str) -> str:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version('{package}'))"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return out.stdout.strip()


def tokenizer_dir(gguf: Path) -> Path:
    """A Hugging Face tokenizer directory made from the GGUF's own vocabulary (bench/overload/tokenizer.py), cached
    by the file's name and size: aiperf builds its prompts with it, and nothing is fetched from a model hub."""
    out = cache_dir() / f"tokenizer-{gguf.stem}-{gguf.stat().st_size}"
    if not (out / "tokenizer.json").exists():
        venv = tool_venv("aiperf")
        tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
        subprocess.run([str(venv / "bin" / "python"), str(HERE / "tokenizer.py"), str(gguf), str(tmp)], check=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


LITELLM_CONFIG = """\
# LiteLLM as it is usually put in front of a server that fails requests: retries on.
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {api_base}/v1
      api_key: none
      timeout: 600
      stream_timeout: 600
litellm_settings:
  num_retries: {retries}
  request_timeout: 600
  drop_params: false
router_settings:
  num_retries: {retries}
  retry_after: 0
  # one deployment: a cooldown would turn every later request into "no deployments available"
  disable_cooldowns: true
general_settings:
  # LiteLLM's health checks send real completions (each takes a server slot): off, as by default
  background_health_checks: false
"""


@contextlib.contextmanager
def litellm_proxy(api_base: str, cpus: set[int] | None, retries: int = 3) -> Iterator[tuple[str, str]]:
    """LiteLLM's proxy (``litellm --config``) in front of ``api_base``; yields its URL and master key (it refuses to
    start without one) once its liveliness probe (no model call) answers."""
    venv = tool_venv("litellm")
    work = Path(tempfile.mkdtemp(prefix="kvctl-litellm-"))
    cfg = work / "config.yaml"
    cfg.write_text(LITELLM_CONFIG.format(model=MODEL_NAME, api_base=api_base, retries=retries))
    port = free_port()
    key = "sk-" + secrets.token_hex(16)
    log = work / "litellm.log"
    env = {
        **os.environ,
        "LITELLM_MASTER_KEY": key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # its model price map is otherwise fetched from GitHub at start
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "DISABLE_SCHEMA_UPDATE": "True",
    }
    cmd = [str(venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--num_workers", "1"]
    proc = spawn_group(cmd, log, env, cpus, cwd=work)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/health/liveliness", proc, log, 120)
        yield url, key
    finally:
        stop_group(proc)
        shutil.rmtree(work, ignore_errors=True)


SYSTEMS = ("upstream", "litellm", "kvctl", "litellm+kvctl")


@contextlib.contextmanager
def system(
    name: str,
    patched: Path,
    unpatched: Path,
    gguf: Path,
    pool: tuple[str, ...],
    cpus: tuple[set[int] | None, set[int] | None],
    kvctl_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, str | None, str, Path]]:
    """Start ``name``; yields (the URL clients use, their API key, the server's URL, the server's log)."""
    srv_cpus, other_cpus = cpus
    with contextlib.ExitStack() as stack:
        if name in ("upstream", "litellm"):
            srv = stack.enter_context(server(unpatched, gguf, *pool, "--metrics", cpus=srv_cpus))
            url = srv.url
        else:
            # kvctl parks and resumes itself; the server's own auto-park stays for when kvctl is gone
            srv = stack.enter_context(
                server(patched, gguf, *pool, "--metrics", "--slots", "--no-auto-park", cpus=srv_cpus)
            )
            env = {"KVCTL_LOG__LEVEL": "warning", **(kvctl_env or {})}
            url = stack.enter_context(start_stack(srv.url, cpus=other_cpus, env=env))
        key = None
        if name.startswith("litellm"):
            url, key = stack.enter_context(litellm_proxy(url, other_cpus))
        yield url, key, srv.url, srv.log_path
