"""Unit tests for testkit.models (no llama-server needed)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from testkit import models
from testkit.models import SIZES, SPEC_KEY, LlamaSpec, spec_fields, write_llama

VOCAB_NAME = "ggml-vocab-llama-spm.gguf"
F32 = gguf.GGMLQuantizationType.F32


@pytest.fixture(scope="module")
def vocab() -> Path:
    # Fail rather than skip: a silently skipped generator test would let a
    # broken fixture reach the server tests.
    vocab_dir = os.environ.get("KVCTL_VOCAB_DIR")
    if not vocab_dir:
        pytest.fail(
            f"KVCTL_VOCAB_DIR is not set; point it at llama.cpp's models/ directory (the one holding {VOCAB_NAME})",
            pytrace=False,
        )
    path = Path(vocab_dir) / VOCAB_NAME
    if not path.is_file():
        pytest.fail(f"KVCTL_VOCAB_DIR={vocab_dir} has no {VOCAB_NAME}", pytrace=False)
    return path


@pytest.fixture(scope="module")
def tiny(vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", vocab)


@pytest.fixture(scope="module")
def tiny_reader(tiny: Path) -> gguf.GGUFReader:
    # GGUFReader takes ~1 s on a 32000-token vocab; parse the shared model once.
    return gguf.GGUFReader(tiny)


def _tensors(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in reader.tensors}


def _stamp(path: Path) -> dict[str, Any]:
    # The module's own header scan: far cheaper than a full GGUFReader parse,
    # and test_spec_key checks it agrees with GGUFReader.
    raw = models._read_stamp(path)
    assert raw is not None, path
    result: dict[str, Any] = json.loads(raw)
    return result


def _scalar(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def test_metadata(tiny_reader: gguf.GGUFReader) -> None:
    r = tiny_reader
    spec = LlamaSpec()
    assert _scalar(r, "general.architecture") == "llama"
    assert _scalar(r, "general.file_type") == 0
    expected = {
        "llama.context_length": spec.n_ctx_train,
        "llama.embedding_length": spec.n_embd,
        "llama.block_count": spec.n_layer,
        "llama.feed_forward_length": spec.n_ff,
        "llama.attention.head_count": spec.n_head,
        "llama.attention.head_count_kv": spec.n_head_kv,
        "llama.rope.dimension_count": spec.n_embd // spec.n_head,
        "llama.vocab_size": 32000,
    }
    for key, value in expected.items():
        assert _scalar(r, key) == value, key
    assert _scalar(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert _scalar(r, "llama.rope.freq_base") == pytest.approx(10000.0)
    assert r.get_field("tokenizer.chat_template") is None


def test_tensor_shapes(tiny_reader: gguf.GGUFReader) -> None:
    spec = LlamaSpec()
    e, hd, ff, v = spec.n_embd, spec.n_embd // spec.n_head, spec.n_ff, 32000
    # ggml ne order, as GGUFReader reports tensor.shape.
    expected: dict[str, list[int]] = {
        "token_embd.weight": [e, v],
        "output_norm.weight": [e],
        "output.weight": [e, v],
    }
    for i in range(spec.n_layer):
        expected |= {
            f"blk.{i}.attn_norm.weight": [e],
            f"blk.{i}.attn_q.weight": [e, spec.n_head * hd],
            f"blk.{i}.attn_k.weight": [e, spec.n_head_kv * hd],
            f"blk.{i}.attn_v.weight": [e, spec.n_head_kv * hd],
            f"blk.{i}.attn_output.weight": [spec.n_head * hd, e],
            f"blk.{i}.ffn_norm.weight": [e],
            f"blk.{i}.ffn_gate.weight": [e, ff],
            f"blk.{i}.ffn_up.weight": [e, ff],
            f"blk.{i}.ffn_down.weight": [ff, e],
        }
    tensors = _tensors(tiny_reader)
    assert set(tensors) == set(expected)
    for name, t in tensors.items():
        assert t.tensor_type == F32, name
        assert [int(d) for d in t.shape] == expected[name], name
        if name.endswith("_norm.weight"):
            assert np.all(t.data == 1.0), name
        else:
            std = spec.embd_std if name in ("token_embd.weight", "output.weight") else spec.hidden_std
            assert float(np.std(t.data)) == pytest.approx(std, rel=0.1), name


def test_tokenizer_copied_exactly(tiny_reader: gguf.GGUFReader, vocab: Path) -> None:
    src, dst = gguf.GGUFReader(vocab), tiny_reader
    src_keys = {k for k in src.fields if k.startswith("tokenizer.ggml.")}
    dst_keys = {k for k in dst.fields if k.startswith("tokenizer.")}
    assert src_keys == dst_keys
    assert {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
    } <= src_keys
    for key in src_keys:
        a, b = src.fields[key], dst.fields[key]
        assert a.types == b.types, key
        # Raw bytes, so a float32 score or a uint32 id that changed type or
        # value in transit cannot compare equal by accident.
        raw_a = [bytes(a.parts[i]) for i in a.data]
        raw_b = [bytes(b.parts[i]) for i in b.data]
        assert raw_a == raw_b, key
        if a.types[0] == gguf.GGUFValueType.ARRAY:
            assert len(raw_b) == 32000, key


def test_spec_key(tiny: Path, tiny_reader: gguf.GGUFReader, vocab: Path) -> None:
    field = tiny_reader.get_field(SPEC_KEY)
    assert field is not None
    assert field.types == [gguf.GGUFValueType.STRING]
    stamp = json.loads(field.contents())
    assert _stamp(tiny) == stamp
    assert stamp["arch"] == "llama"
    assert stamp["spec"] == spec_fields(LlamaSpec())
    assert stamp["vocab_sha256"] == hashlib.sha256(vocab.read_bytes()).hexdigest()


def test_deterministic(tiny: Path, tiny_reader: gguf.GGUFReader, vocab: Path, tmp_path: Path) -> None:
    again = write_llama(tmp_path / "again.gguf", vocab)
    assert again.read_bytes() == tiny.read_bytes()

    seed1 = write_llama(tmp_path / "seed1.gguf", vocab, LlamaSpec(seed=1))
    other = _tensors(gguf.GGUFReader(seed1))
    for name, t in _tensors(tiny_reader).items():
        same = t.data.tobytes() == other[name].data.tobytes()
        # Norms are constant ones; every random matrix must change with the seed.
        assert same == name.endswith("_norm.weight"), name


def test_skip_when_spec_unchanged(vocab: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_llama(path, vocab)
    # An old, distinctive mtime makes "untouched" unambiguous even on
    # filesystems with coarse timestamps.
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    inode = path.stat().st_ino

    write_llama(path, vocab, LlamaSpec())
    assert path.stat().st_mtime_ns == 1_000_000_000
    assert path.stat().st_ino == inode

    write_llama(path, vocab, LlamaSpec(seed=7))
    assert path.stat().st_mtime_ns != 1_000_000_000
    assert _stamp(path)["spec"]["seed"] == 7
    # The atomic write must not leave its temp file behind.
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_corrupt_target_is_rewritten(vocab: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00 truncated")
    write_llama(path, vocab)
    assert _stamp(path)["spec"] == spec_fields(LlamaSpec())


def test_cli(vocab: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    argv = ["llama", "--vocab", str(vocab), "--out", str(out), "--size", "tiny"]
    rc = models.main([*argv, "--seed", "3", "--n-layer", "1", "--hidden-std", "0.1"])
    assert rc == 0
    assert str(out) in capsys.readouterr().out
    assert _stamp(out)["spec"] == spec_fields(LlamaSpec(seed=3, n_layer=1, hidden_std=0.1))


def test_sizes_and_validation() -> None:
    assert SIZES["tiny"] == LlamaSpec()
    bench = SIZES["bench"]
    assert (bench.n_embd, bench.n_layer, bench.n_head, bench.n_ff) == (512, 2, 8, 1024)
    with pytest.raises(ValueError):
        LlamaSpec(n_embd=65)
    with pytest.raises(ValueError):
        LlamaSpec(n_head=4, n_head_kv=3)


@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
def test_quantized_weights(weights: str, vocab: Path, tmp_path: Path) -> None:
    """The matrices carry the quantized type, the norms stay F32, the file type says so, and the stamp (so the
    cache) tells the quantized model from the F32 one; an F32 spec's stamp is unchanged by the field."""
    out = write_llama(tmp_path / "q.gguf", vocab, LlamaSpec(weights=weights))
    reader = gguf.GGUFReader(out)
    qtype, file_type = models.WEIGHT_TYPES[weights]
    tensors = _tensors(reader)
    assert tensors["blk.0.attn_q.weight"].tensor_type == qtype
    assert tensors["token_embd.weight"].tensor_type == qtype
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert _scalar(reader, "general.file_type") == file_type
    assert _stamp(out)["spec"]["weights"] == weights
    assert "weights" not in spec_fields(LlamaSpec())


def test_weights_validation() -> None:
    with pytest.raises(ValueError, match="weights must be one of"):
        LlamaSpec(weights="q5_k")
    with pytest.raises(ValueError, match="multiples of 32"):
        LlamaSpec(n_embd=48, n_head=4, n_head_kv=4, weights="q4_0")
