"""Seedable random-weight GGUF models for tests and benchmarks.

The models are useless as language models but real to llama.cpp: correct
architecture metadata, a real tokenizer copied from one of llama.cpp's
``models/ggml-vocab-*.gguf`` files, and random F32 weights.  Outputs are a
pure function of (spec, vocab file, generator version), so fixtures can call
the writers on every test run: an up-to-date file is left untouched.

Usage::

    python -m testkit.models llama --vocab ggml-vocab-llama-spm.gguf \\
        --out tiny.gguf [--size tiny|bench] [--seed N] [--n-embd N] ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
import numpy.typing as npt

__all__ = ["SIZES", "SPEC_KEY", "LlamaSpec", "Qwen35Spec", "main", "write_llama", "write_qwen35"]

SPEC_KEY = "kvctl.testmodel.spec"

# Part of the stamp, so files written by an older generator (different tensor
# draw order, different metadata) are regenerated instead of silently reused.
# Bump whenever the bytes produced for a given spec change.
_GENERATOR_VERSION = 1

_TOKENIZER_PREFIX = "tokenizer.ggml."

# llama.cpp's GGML_QNT_VERSION; the convert scripts always write it, so do the
# same to look like any other converted model.
_QUANTIZATION_VERSION = 2


# a spec's ``weights``: the GGML type of its matrices and the file type the GGUF declares
WEIGHT_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}


@dataclass(frozen=True)
class LlamaSpec:
    """Shape and seed of a random llama model; the defaults are the "tiny" size."""

    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 128
    n_ctx_train: int = 32768
    seed: int = 0
    # These scales were measured so that greedy decoding depends on the
    # context instead of collapsing into short loops; keep them as defaults.
    embd_std: float = 1.0  # token_embd and output
    hidden_std: float = 0.2  # every other matrix
    head_dim_kv: int = 0  # 0: n_embd / n_head; else heads this wide (many KV bytes a cell from a small model)
    # the matrices' type: f32, or q8_0 / q4_0 quantized by gguf-py (the norms stay f32), as a user's quantized
    # model would load (the quantized CPU kernels, the repacking of the extra buffer types)
    weights: str = "f32"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_TYPES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_TYPES)}, got {self.weights!r}")
        if self.weights != "f32" and (self.n_embd % 32 or self.n_ff % 32 or (self.n_head * self.head_dim) % 32):
            raise ValueError(f"{self.weights} weights need n_embd, n_ff and n_head * head_dim multiples of 32")
        if self.head_dim_kv < 0:
            raise ValueError(f"head_dim_kv must be non-negative, got {self.head_dim_kv}")
        for name in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_ctx_train"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        if not (self.embd_std > 0 and self.hidden_std > 0):
            raise ValueError("embd_std and hidden_std must be positive")

    @property
    def head_dim(self) -> int:
        return self.head_dim_kv or self.n_embd // self.n_head


SIZES: dict[str, LlamaSpec] = {
    "tiny": LlamaSpec(),
    "bench": LlamaSpec(n_embd=512, n_layer=2, n_head=8, n_head_kv=8, n_ff=1024),
    # ~0.85 B parameters (3.4 GB of F32): for the GPU benchmarks (bench/gpu.sh), never on the CPU runners
    "gpu": LlamaSpec(n_embd=2048, n_layer=16, n_head=16, n_head_kv=4, n_ff=5632),
    # 32 layers of 16 KV heads of 128: 256 KiB of f16 KV a cell (512 KiB in f32) from 17 M parameters, so GiB
    # snapshots take seconds of prefill on a CPU (bench/park_speed.py)
    "kvheavy": LlamaSpec(n_embd=64, n_layer=32, n_head=16, n_head_kv=16, n_ff=128, head_dim_kv=128),
    # 64 layers of 2 KV heads of 32 (q8_0 needs heads of 32): 32 KiB of f32 KV a cell in rows of 68-256 B, many
    # small tensors, the layout where a copy's per-row and per-layer costs show (bench/park_speed.py)
    "kv64": LlamaSpec(n_embd=64, n_layer=64, n_head=2, n_head_kv=2, n_ff=128),
}


# ---------------------------------------------------------------------------
# Shared helpers (architecture independent)
# ---------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    # Vocab files are at most a few MB, so hashing them is cheap, and it
    # catches a fixture pointed at a different tokenizer under the same name.
    return hashlib.sha256(path.read_bytes()).hexdigest()


def spec_fields(spec: Any) -> dict[str, Any]:
    """The spec as its stamp holds it: a field at its default of "absent" (head_dim_kv 0) stays out, so that
    adding it kept the stamps, and the cached models, of every earlier spec."""
    absent = {"head_dim_kv": 0, "weights": "f32"}
    return {k: v for k, v in dataclasses.asdict(spec).items() if not (k in absent and absent[k] == v)}


def _stamp(arch: str, spec: Any, vocab_sha256: str) -> str:
    """Canonical JSON identifying everything the output bytes depend on."""
    return json.dumps(
        {
            "arch": arch,
            "generator": _GENERATOR_VERSION,
            "spec": spec_fields(spec),
            "vocab_sha256": vocab_sha256,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


# Byte sizes of scalar GGUF values, to step over keys ahead of the stamp.
_SCALAR_SIZES: dict[int, int] = {
    gguf.GGUFValueType.UINT8: 1,
    gguf.GGUFValueType.INT8: 1,
    gguf.GGUFValueType.BOOL: 1,
    gguf.GGUFValueType.UINT16: 2,
    gguf.GGUFValueType.INT16: 2,
    gguf.GGUFValueType.UINT32: 4,
    gguf.GGUFValueType.INT32: 4,
    gguf.GGUFValueType.FLOAT32: 4,
    gguf.GGUFValueType.UINT64: 8,
    gguf.GGUFValueType.INT64: 8,
    gguf.GGUFValueType.FLOAT64: 8,
}

# _write_model puts the stamp right after general.architecture, so a file
# of ours has it within the first few keys.
_STAMP_SCAN_KEYS = 8


def _read_gguf_str(f: BinaryIO) -> bytes:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > 1 << 20:
        raise ValueError("implausible string length")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated string")
    return data


def _read_stamp(path: Path) -> str | None:
    """The stamp stored in an existing file, or None if absent or unreadable.

    Deliberately not gguf.GGUFReader: it parses every key up front, and the
    32000-entry tokenizer arrays make that take ~0.5-1 s, as long as writing
    a tiny model, which would defeat the point of skipping the rewrite.
    Reading the header up to the stamp takes well under a millisecond.
    """
    try:
        with open(path, "rb") as f:
            magic, version, _n_tensors, n_kv = struct.unpack("<IIQQ", f.read(24))
            if magic != gguf.GGUF_MAGIC or version not in (2, 3):
                return None
            for _ in range(min(n_kv, _STAMP_SCAN_KEYS)):
                key = _read_gguf_str(f)
                (vtype,) = struct.unpack("<I", f.read(4))
                if vtype == gguf.GGUFValueType.STRING:
                    value = _read_gguf_str(f)
                    if key == SPEC_KEY.encode():
                        return value.decode("utf-8", errors="replace")
                elif vtype in _SCALAR_SIZES:
                    f.seek(_SCALAR_SIZES[vtype], os.SEEK_CUR)
                else:
                    # Arrays before the stamp: not a file we wrote.
                    return None
    except (OSError, ValueError, struct.error):
        # A truncated or foreign file is simply regenerated.
        return None
    return None


def _field_value(
    field: gguf.ReaderField,
) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """(value, type, array element type) of a reader field, ready for GGUFWriter."""
    main_type = field.types[0]
    if main_type == gguf.GGUFValueType.ARRAY:
        if len(field.types) == 1:
            # The reader only records the element type of a non-empty array,
            # and GGUFWriter refuses to write empty ones anyway.
            raise ValueError(f"{field.name}: empty arrays cannot be copied")
        if len(field.types) > 2:
            # The reader flattens nested arrays, so they cannot be copied faithfully.
            raise ValueError(f"{field.name}: nested arrays are not supported")
        sub_type = field.types[1]
        items: tuple[Any, ...]
        if sub_type == gguf.GGUFValueType.STRING:
            # Raw bytes, not field.contents(): token strings are copied
            # byte-for-byte even if a vocab ever holds invalid UTF-8.
            items = tuple(bytes(field.parts[i]) for i in field.data)
        else:
            # Tuples, not lists: these values live on in the lru_cache.
            items = tuple(field.parts[i].tolist()[0] for i in field.data)
        return items, main_type, sub_type
    if main_type == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]), main_type, None
    return field.parts[-1].tolist()[0], main_type, None


# (key, value, type, array element type), ready for GGUFWriter.add_key_value.
_KV = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


@functools.lru_cache(maxsize=4)
def _tokenizer_kvs(vocab: Path, vocab_sha256: str) -> tuple[_KV, ...]:
    """The tokenizer.ggml.* keys of a vocab file, cached by content hash.

    GGUFReader spends ~0.5-1 s building per-token numpy views of a 32000-entry
    vocab, which is most of the cost of writing a tiny model; test sessions
    write several, so parse each vocab once per process.  ``vocab_sha256`` is
    part of the cache key so an edited file is reparsed.
    """
    reader = gguf.GGUFReader(vocab)
    return tuple(
        (name, *_field_value(field)) for name, field in reader.fields.items() if name.startswith(_TOKENIZER_PREFIX)
    )


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab: Path, vocab_sha256: str) -> int:
    """Copy every tokenizer.ggml.* key with its exact type; return the vocab size."""
    n_vocab: int | None = None
    for name, value, vtype, sub_type in _tokenizer_kvs(vocab.resolve(), vocab_sha256):
        # add_key_value rather than add_string/add_array: those silently drop
        # empty values, and add_array infers the element type from Python
        # values (ints become INT32), which would change uint32 arrays.
        writer.add_key_value(name, value, vtype, sub_type)
        if name == gguf.Keys.Tokenizer.LIST:
            n_vocab = len(value)
    if n_vocab is None:
        raise ValueError(f"{vocab}: no {gguf.Keys.Tokenizer.LIST} array")
    return n_vocab


@contextlib.contextmanager
def _atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; move it into place only on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory so os.replace is a rename, never a cross-device copy;
    # readers (e.g. a concurrently starting llama-server) see old or new, never half.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp creates 0600; model files are meant to be shared.
        os.chmod(tmp, 0o644)
        with open(tmp, "rb") as f:
            # Without this a crash right after the rename can leave an empty
            # file under the final name, which the stamp check would then
            # have to detect as corrupt.
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_model(
    path: Path,
    arch: str,
    stamp: str,
    populate: Callable[[gguf.GGUFWriter], None],
) -> Path:
    """Write a GGUF atomically unless ``path`` already carries ``stamp``."""
    if path.exists() and _read_stamp(path) == stamp:
        return path
    with _atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)  # also sets general.architecture
        try:
            # First key after the architecture: _read_stamp only scans the
            # head of the file.
            writer.add_string(SPEC_KEY, stamp)
            populate(writer)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return path


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
    # Drawing float32 directly is about twice as fast as float64 + astype,
    # which matters for the bench-size embedding matrices.
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)
    return out


# ---------------------------------------------------------------------------
# llama
# ---------------------------------------------------------------------------


def write_llama(path: Path, vocab: Path, spec: LlamaSpec = LlamaSpec()) -> Path:
    """Write a random-weight llama GGUF to ``path`` (skipped if already up to date).

    ``vocab`` is a llama.cpp vocab-only GGUF (e.g. ggml-vocab-llama-spm.gguf)
    whose tokenizer is copied verbatim.  Returns ``path``.
    """
    path = Path(path)
    vocab = Path(vocab)
    vocab_sha256 = _sha256(vocab)
    stamp = _stamp("llama", spec, vocab_sha256)

    def populate(w: gguf.GGUFWriter) -> None:
        n_vocab = _copy_tokenizer(w, vocab, vocab_sha256)
        hd = spec.head_dim

        qtype, file_type = WEIGHT_TYPES[spec.weights]
        w.add_name("kvctl-testmodel-llama")
        w.add_file_type(file_type)
        w.add_quantization_version(_QUANTIZATION_VERSION)
        w.add_context_length(spec.n_ctx_train)
        w.add_embedding_length(spec.n_embd)
        w.add_block_count(spec.n_layer)
        w.add_feed_forward_length(spec.n_ff)
        w.add_head_count(spec.n_head)
        w.add_head_count_kv(spec.n_head_kv)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_dimension_count(hd)
        if spec.head_dim_kv:
            w.add_key_length(hd)
            w.add_value_length(hd)
        w.add_rope_freq_base(10000.0)
        w.add_vocab_size(n_vocab)

        # Tensors are drawn in file order from one generator, so the bytes are
        # a function of the seed alone; changing this order changes every
        # model and needs a _GENERATOR_VERSION bump.
        rng = np.random.default_rng(spec.seed)
        ones = np.ones(spec.n_embd, dtype=np.float32)

        def matrix(name: str, data: npt.NDArray[np.float32]) -> None:
            if qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

        # numpy shapes are ggml ne reversed: token_embd is ne {n_embd, n_vocab}.
        matrix("token_embd.weight", _normal(rng, (n_vocab, spec.n_embd), spec.embd_std))
        for i in range(spec.n_layer):
            std = spec.hidden_std
            w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
            matrix(
                f"blk.{i}.attn_q.weight",
                _normal(rng, (spec.n_head * hd, spec.n_embd), std),
            )
            matrix(
                f"blk.{i}.attn_k.weight",
                _normal(rng, (spec.n_head_kv * hd, spec.n_embd), std),
            )
            matrix(
                f"blk.{i}.attn_v.weight",
                _normal(rng, (spec.n_head_kv * hd, spec.n_embd), std),
            )
            matrix(
                f"blk.{i}.attn_output.weight",
                _normal(rng, (spec.n_embd, spec.n_head * hd), std),
            )
            w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
            matrix(f"blk.{i}.ffn_gate.weight", _normal(rng, (spec.n_ff, spec.n_embd), std))
            matrix(f"blk.{i}.ffn_up.weight", _normal(rng, (spec.n_ff, spec.n_embd), std))
            matrix(f"blk.{i}.ffn_down.weight", _normal(rng, (spec.n_embd, spec.n_ff), std))
        w.add_tensor("output_norm.weight", ones)
        matrix("output.weight", _normal(rng, (n_vocab, spec.n_embd), spec.embd_std))

    return _write_model(path, "llama", stamp, populate)


# ---------------------------------------------------------------------------
# qwen35: hybrid memory (gated delta net + attention) with an MTP layer
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen35Spec:
    """A tiny Qwen3.5 hybrid model with one MTP layer (shared/design/test-models.md).

    Layers 0..2 are recurrent (gated delta net), layer 3 is full attention, layer 4 is the MTP
    layer. The scales were measured so that ~42 % of MTP drafts are accepted while greedy output
    stays context-dependent: all random weights would reject every draft.
    """

    seed: int = 0
    n_ctx_train: int = 32768
    # measured (CPU, greedy, 200 tokens): 1.0 -> 121 distinct ids, 45 % of drafts accepted;
    # 3.0 -> 197 distinct ids, 61 % accepted; 0.3 -> 197 distinct, 13 % accepted
    embd_std: float = 3.0  # token_embd and output
    trunk_std: float = 0.05  # trunk hidden weights
    mtp_std: float = 0.02  # MTP block weights
    eh_mix_std: float = 0.1 / 8.0  # eh_proj's hidden half: a small mix on top of identity


QWEN35_N_EMBD = 64
QWEN35_N_FF = 128
QWEN35_N_TRUNK = 4  # 3 recurrent + 1 attention
QWEN35_HEAD_DIM = 32


def write_qwen35(path: Path, vocab: Path, spec: Qwen35Spec = Qwen35Spec()) -> Path:
    """Write a random-weight qwen35 GGUF with an MTP layer (skipped if already up to date).

    ``vocab`` is llama.cpp's ggml-vocab-qwen35.gguf. Serve it with ``--spec-type draft-mtp``
    (no draft model needed); without it the MTP tensors are skipped.
    """
    path = Path(path)
    vocab = Path(vocab)
    vocab_sha256 = _sha256(vocab)
    stamp = _stamp("qwen35", spec, vocab_sha256)
    n_embd, n_ff, hd = QWEN35_N_EMBD, QWEN35_N_FF, QWEN35_HEAD_DIM
    n_head, n_head_kv = 4, 2
    ssm_state, ssm_groups, ssm_rank, ssm_inner, ssm_kernel = 16, 2, 4, 64, 4
    conv_dim = 2 * ssm_state * ssm_groups + ssm_inner  # q, k (per group) and v

    def populate(w: gguf.GGUFWriter) -> None:
        n_vocab = _copy_tokenizer(w, vocab, vocab_sha256)
        a = "qwen35"
        w.add_name("kvctl-testmodel-qwen35-mtp")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_quantization_version(_QUANTIZATION_VERSION)
        w.add_uint32(f"{a}.context_length", spec.n_ctx_train)
        w.add_uint32(f"{a}.embedding_length", n_embd)
        w.add_uint32(f"{a}.block_count", QWEN35_N_TRUNK + 1)
        w.add_uint32(f"{a}.nextn_predict_layers", 1)
        w.add_uint32(f"{a}.full_attention_interval", 4)
        w.add_uint32(f"{a}.feed_forward_length", n_ff)
        w.add_uint32(f"{a}.attention.head_count", n_head)
        w.add_uint32(f"{a}.attention.head_count_kv", n_head_kv)
        w.add_uint32(f"{a}.attention.key_length", hd)
        w.add_uint32(f"{a}.attention.value_length", hd)
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_uint32(f"{a}.rope.dimension_count", 8)
        w.add_array(f"{a}.rope.dimension_sections", [2, 1, 1, 0])
        w.add_float32(f"{a}.rope.freq_base", 1e7)
        w.add_uint32(f"{a}.ssm.conv_kernel", ssm_kernel)
        w.add_uint32(f"{a}.ssm.state_size", ssm_state)
        w.add_uint32(f"{a}.ssm.group_count", ssm_groups)
        w.add_uint32(f"{a}.ssm.time_step_rank", ssm_rank)
        w.add_uint32(f"{a}.ssm.inner_size", ssm_inner)
        w.add_uint32(f"{a}.vocab_size", n_vocab)

        rng = np.random.default_rng(spec.seed)
        ones = np.ones(n_embd, dtype=np.float32)

        def t(name: str, shape: tuple[int, ...], std: float) -> None:
            w.add_tensor(name, _normal(rng, shape, std))

        def attention(i: int, std: float) -> None:
            t(f"blk.{i}.attn_q.weight", (2 * n_head * hd, n_embd), std)  # query and its gate
            t(f"blk.{i}.attn_k.weight", (n_head_kv * hd, n_embd), std)
            t(f"blk.{i}.attn_v.weight", (n_head_kv * hd, n_embd), std)
            t(f"blk.{i}.attn_output.weight", (n_embd, n_head * hd), std)
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(hd, dtype=np.float32))

        def block(i: int, std: float) -> None:
            w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
            w.add_tensor(f"blk.{i}.post_attention_norm.weight", ones)
            t(f"blk.{i}.ffn_gate.weight", (n_ff, n_embd), std)
            t(f"blk.{i}.ffn_up.weight", (n_ff, n_embd), std)
            t(f"blk.{i}.ffn_down.weight", (n_embd, n_ff), std)

        t("token_embd.weight", (n_vocab, n_embd), spec.embd_std)
        for i in range(QWEN35_N_TRUNK):
            block(i, spec.trunk_std)
            if i < QWEN35_N_TRUNK - 1:  # gated delta net
                t(f"blk.{i}.attn_qkv.weight", (conv_dim, n_embd), spec.trunk_std)
                t(f"blk.{i}.attn_gate.weight", (ssm_inner, n_embd), spec.trunk_std)
                t(f"blk.{i}.ssm_conv1d.weight", (conv_dim, ssm_kernel), spec.trunk_std)
                w.add_tensor(f"blk.{i}.ssm_dt.bias", np.zeros(ssm_rank, dtype=np.float32))
                w.add_tensor(f"blk.{i}.ssm_a", -rng.uniform(1.0, 16.0, ssm_rank).astype(np.float32))
                t(f"blk.{i}.ssm_beta.weight", (ssm_rank, n_embd), spec.trunk_std)
                t(f"blk.{i}.ssm_alpha.weight", (ssm_rank, n_embd), spec.trunk_std)
                w.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones(ssm_state, dtype=np.float32))
                t(f"blk.{i}.ssm_out.weight", (n_embd, ssm_inner), spec.trunk_std)
            else:
                attention(i, spec.trunk_std)
        mtp = QWEN35_N_TRUNK
        block(mtp, spec.mtp_std)
        attention(mtp, spec.mtp_std)
        # the MTP layer sees concat(embedding, hidden): identity on the embedding half makes its
        # drafts follow the trunk often enough to be accepted sometimes
        eh = np.zeros((n_embd, 2 * n_embd), dtype=np.float32)
        eh[:, :n_embd] = np.eye(n_embd, dtype=np.float32)
        eh[:, n_embd:] = _normal(rng, (n_embd, n_embd), spec.eh_mix_std)
        w.add_tensor(f"blk.{mtp}.nextn.eh_proj.weight", eh)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            w.add_tensor(f"blk.{mtp}.nextn.{norm}.weight", ones)
        w.add_tensor("output_norm.weight", ones)
        t("output.weight", (n_vocab, n_embd), spec.embd_std)

    return _write_model(path, "qwen35", stamp, populate)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _add_spec_overrides(parser: argparse.ArgumentParser, template: Any) -> None:
    """One --flag per spec field, typed from its default: new fields need no edit."""
    for f in dataclasses.fields(template):
        default = getattr(template, f.name)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=type(default),
            default=None,
            help=f"override {f.name} (tiny default: {default})",
        )


def _overrides(args: argparse.Namespace, template: Any) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(template) if getattr(args, f.name) is not None}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m testkit.models",
        description="Write seedable random-weight GGUF test models.",
    )
    sub = parser.add_subparsers(dest="arch", required=True)

    llama = sub.add_parser("llama", help="llama architecture, tokenizer copied from --vocab")
    llama.add_argument(
        "--vocab",
        type=Path,
        required=True,
        help="vocab-only GGUF to copy the tokenizer from",
    )
    llama.add_argument("--out", type=Path, required=True, help="output GGUF path")
    llama.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="base size (default: tiny)",
    )
    _add_spec_overrides(llama, LlamaSpec())

    qwen = sub.add_parser(
        "qwen35", help="tiny Qwen3.5 hybrid model with an MTP layer (serve with --spec-type draft-mtp)"
    )
    qwen.add_argument("--vocab", type=Path, required=True, help="ggml-vocab-qwen35.gguf")
    qwen.add_argument("--out", type=Path, required=True, help="output GGUF path")
    _add_spec_overrides(qwen, Qwen35Spec())
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.arch == "llama":
        try:
            spec = dataclasses.replace(SIZES[args.size], **_overrides(args, LlamaSpec()))
        except ValueError as e:
            parser.error(str(e))
        if not args.vocab.is_file():
            parser.error(f"vocab file not found: {args.vocab}")
        t0 = time.monotonic()
        out = write_llama(args.out, args.vocab, spec)
        elapsed = time.monotonic() - t0
        print(f"{out}: {out.stat().st_size} bytes, {elapsed:.2f}s, spec={spec}")
        return 0
    if args.arch == "qwen35":
        if not args.vocab.is_file():
            parser.error(f"vocab file not found: {args.vocab}")
        qspec = dataclasses.replace(Qwen35Spec(), **_overrides(args, Qwen35Spec()))
        out = write_qwen35(args.out, args.vocab, qspec)
        print(f"{out}: {out.stat().st_size} bytes, spec={qspec}")
        return 0
    parser.error(f"unknown architecture {args.arch!r}")


if __name__ == "__main__":
    sys.exit(main())
