"""A planned restart's checks before anything stops (controller.planned): which model a command line serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.errors import KvctlError
from controller.planned import model_identity


def test_a_command_lines_model_is_its_file_name_size_alias_and_kv_types(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    base = ["llama-server", "-m", str(model), "-c", "4096"]
    a = model_identity(base)
    assert (a.model, a.size, a.alias, a.cache_type_k, a.cache_type_v) == ("m.gguf", 10, None, "f16", "f16")
    assert model_identity([*base, "--seed", "7", "-np", "8"]) == a, "other flags change nothing a request needs"
    b = model_identity(["llama-server", f"--model={model}", "-ctk", "q8_0", "-ctv", "q8_0", "-a", "chat"])
    assert a.differences(b) == [
        "alias: None -> 'chat'",
        "cache_type_k: 'f16' -> 'q8_0'",
        "cache_type_v: 'f16' -> 'q8_0'",
    ]
    model.write_bytes(b"x" * 11)  # a new quantization under the same name
    assert model_identity(base).differences(a) == ["size: 11 -> 10"]


@pytest.mark.parametrize("argv", [["llama-server", "-c", "8"], ["llama-server", "-m"], ["llama-server", "-m", "/nope"]])
def test_a_command_line_without_a_readable_model_is_refused(argv: Any) -> None:
    with pytest.raises(KvctlError) as e:
        model_identity(argv)
    assert e.value.status == 400 and e.value.code == "invalid_argv"
