"""scripts/quickstart.sh --demo: the first five minutes of an operator, end to end."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path

from testkit.llama import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_demo_answers_and_completes_every_chat(llama_server_bin: Path) -> None:
    env = {
        **os.environ,
        "PORT": str(free_port()),
        "ADMIN_PORT": str(free_port()),
        "SERVER_PORT": str(free_port()),
    }
    # the demo's own sizing on the CPU: 4 chats of 640 tokens and their prompts, a 2048-cell pool (131 %)
    for name in ("CTX", "CHATS", "TOKENS", "MODEL"):
        env.pop(name, None)
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--demo"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "4/4 chats completed" in res.stdout
    answer = next(line for line in res.stdout.splitlines() if line.startswith("demo: answer: "))
    assert "Paris" in answer, "the default model is a real one, and it answers"
    assert "SmolLM2-135M-Instruct" in res.stderr
    parks = res.stdout.split("parks: ", 1)[1]
    assert not parks.startswith("0 by kvctl, 0 by"), "the burst must overflow the pool, or the demo shows nothing"
    assert "4 concurrent chats of 640 tokens" in res.stdout and "the pool has 2048" in res.stdout
    assert "MODEL=/path/to/model.gguf scripts/quickstart.sh" in res.stderr, "it says how to try one's own model"
    # it shut down cleanly: no server or kvctl left behind on its ports
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--port {env['SERVER_PORT']}" not in ps and f"127.0.0.1:{env['ADMIN_PORT']}" not in ps


def test_quickstart_refuses_unknown_arguments() -> None:
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--bogus"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "unknown argument" in res.stderr


def fake_tools(tmp_path: Path, *names: str) -> dict[str, str]:
    """An environment whose PATH has stand-ins for ``names`` (nvidia-smi lists one GPU; nvcc prints a version) and
    none of this machine's own GPU tools (a developer's machine may have nvcc on PATH or in /usr/local/cuda)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scripts = {
        "nvidia-smi": 'echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"',
        "nvcc": 'echo "Cuda compilation tools, release 13.0"',
    }
    for name in names:
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{scripts[name]}\n")
        tool.chmod(0o755)
    own = [p for p in os.environ["PATH"].split(":") if not any((Path(p) / t).exists() for t in ("nvcc", "nvidia-smi"))]
    return {**os.environ, "PATH": ":".join([str(bin_dir), *own]), "CUDA_HOME": str(tmp_path / "no-cuda")}


def dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_quickstart_builds_for_cuda_and_offloads_where_a_gpu_and_nvcc_are_found(tmp_path: Path) -> None:
    res = dry_run(fake_tools(tmp_path, "nvidia-smi", "nvcc"))
    assert res.returncode == 0, res.stderr
    assert "backend: CUDA (found GPU 0: NVIDIA H200" in res.stderr
    assert "scripts/build_llama.sh --cuda" in res.stderr and "-ngl all" in res.stderr


def test_quickstart_stays_on_the_cpu_and_says_why(tmp_path: Path) -> None:
    gpu_only = dry_run(fake_tools(tmp_path, "nvidia-smi"))
    assert gpu_only.returncode == 0, gpu_only.stderr
    assert "backend: CPU (found GPU 0: NVIDIA H200" in gpu_only.stderr and "no nvcc" in gpu_only.stderr
    assert "--cuda" not in gpu_only.stderr.split("backend:", 1)[1].split("\n", 1)[1]
    assert "-ngl" not in gpu_only.stderr

    forced = dry_run(fake_tools(tmp_path, "nvidia-smi", "nvcc"), "--cpu")
    assert forced.returncode == 0 and "backend: CPU (--cpu)" in forced.stderr and "-ngl" not in forced.stderr


def test_quickstart_cuda_without_nvcc_is_refused(tmp_path: Path) -> None:
    res = dry_run(fake_tools(tmp_path), "--cuda")
    assert res.returncode == 2 and "--cuda needs the CUDA toolkit's nvcc" in res.stderr


def test_quickstart_prints_the_webui_address_and_stops_on_ctrl_c(llama_server_bin: Path) -> None:
    port, admin, sport = free_port(), free_port(), free_port()
    env = {**os.environ, "PORT": str(port), "ADMIN_PORT": str(admin), "SERVER_PORT": str(sport)}
    with subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "quickstart.sh")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the whole foreground group: send it to the group
    ) as proc:
        assert proc.stderr is not None
        lines: list[str] = []
        try:
            for line in proc.stderr:
                lines.append(line)
                if "ready:" in line or "kvctl exited" in line:
                    break
            # keep reading what kvctl logs, or a full pipe would stop it
            drain = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
            drain.start()
            said = "".join(lines)
            assert f"ready: open http://127.0.0.1:{port}/ in a browser for the WebUI, through kvctl" in said, said
            # the server keeps the WebUI gzipped and answers 415 to a client that does not take gzip
            page = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Accept-Encoding": "gzip"})
            with urllib.request.urlopen(page, timeout=10) as resp:
                assert resp.status == 200 and b"<html" in gzip.decompress(resp.read()).lower()
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=60)
    assert rc in (0, 130, 143), f"exit status {rc}"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--port {sport}" not in ps and f"127.0.0.1:{admin}" not in ps, "Ctrl-C left kvctl or its server running"
