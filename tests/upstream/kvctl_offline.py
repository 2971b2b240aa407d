"""pytest plugin: run llama.cpp's server tests offline, on a generated random-weight model.

Loaded into upstream's own test suite (tools/server/tests) with ``-p kvctl_offline``:
- every server a test starts loads ``$KVCTL_UPSTREAM_MODEL`` instead of downloading its
  Hugging Face model (the presets' downloads are switched off);
- a test server runs with one thread unless the test sets another count (on a 2-core CI
  runner ggml's spinning threads collapse when they share cores).

Tests that depend on what a trained model says fail here, patched or not; the baseline of
unpatched results (tests/upstream/baseline.json) records which ones pass.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest


def _no_downloads() -> types.ModuleType:
    mod = types.ModuleType("wget")

    def download(url: str, *args: object, **kwargs: object) -> str:
        raise RuntimeError(f"offline test run: not downloading {url}")

    mod.download = download  # type: ignore[attr-defined]
    return mod


# before upstream's conftest.py imports utils.py, which imports wget
sys.modules.setdefault("wget", _no_downloads())


def pytest_configure(config: pytest.Config) -> None:
    model = os.environ.get("KVCTL_UPSTREAM_MODEL")
    if not model or not os.path.isfile(model):
        raise pytest.UsageError("KVCTL_UPSTREAM_MODEL must name a GGUF file")
    sys.path.insert(0, str(config.rootpath))
    import utils  # type: ignore[import-not-found]  # upstream's tools/server/tests/utils.py

    server_cls = utils.ServerProcess
    start = server_cls.start

    def offline_start(self: Any, *args: object, **kwargs: object) -> None:
        if self.model_hf_repo or self.model_url:
            self.model_hf_repo = self.model_hf_file = self.model_url = None
            self.model_file = model
        if self.n_threads is None:
            self.n_threads = 1
        self.mmproj_url = None
        start(self, *args, **kwargs)

    server_cls.start = offline_start
    utils.ServerPreset.load_all = staticmethod(lambda: None)
