"""Write a Hugging Face tokenizer directory from a GGUF file's own vocabulary, offline.

Runs in the load generator's venv (``bench.overload`` calls it there): ``python tokenizer.py MODEL.gguf OUT_DIR``.
transformers converts a GGUF vocabulary itself (``integrations.gguf.gguf_tokenizer_mapping``), but its GGUF reader
imports torch; the metadata is read here with the ``gguf`` package instead, and handed to the same converter.
"""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    _SPECIAL_TOKENS,
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)


def metadata(path: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, field in GGUFReader(path).fields.items():
        if not field.types:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            inner = field.types[-1]
            parts = [field.parts[i] for i in field.data]
            out[name] = [
                bytes(p).decode("utf-8", "replace") if inner == GGUFValueType.STRING else p.tolist()[0] for p in parts
            ]
        elif kind == GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        else:
            value = field.parts[field.data[0]]
            out[name] = value.tolist()[0] if isinstance(value, np.ndarray) else value
    return out


def main(gguf_path: str, out_dir: str) -> None:
    meta = metadata(gguf_path)
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    fast, extra = convert_gguf_tokenizer(str(meta["general.architecture"]), tokenizer)
    kwargs = {k: v for k, v in {**config, **extra}.items() if v is not None}
    PreTrainedTokenizerFast(tokenizer_object=fast, **kwargs).save_pretrained(out_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
