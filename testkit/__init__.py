"""kvctl's development kit: what the tests, the benchmarks and the quickstart share, and none of it ships.

- ``testkit.models``: random-weight GGUF models for tests and demos (``python -m testkit.models``; extra ``models``)
- ``testkit.demo``: concurrent chats through kvctl's proxy (``python -m testkit.demo``; extra ``demo``)
- ``testkit.llama``: a real llama-server child process, and a client for its streams, actions and metrics
- ``testkit.stack``: ``kvctl run`` in its own process in front of a server
- ``testkit.snapshots``: ``GET /kv`` snapshots built in code, for the policy's tests and its simulation
- ``testkit.policy_sim``: the policy on a simulated server, step by step (tests/unit/test_policy_sim.py and
  ``python -m bench.policy_sim``)

The kvctl wheel holds only ``controller``: testkit is not installed, it is imported from the checkout. The
repository root must be on ``sys.path``, as it is for ``python -m testkit.models`` run from the root and under pytest
(the rootdir of ``tests/``) and the benchmarks (``bench/common.py`` puts it there). Its dependencies are the
extras: ``pip install -e ".[models]"``, ``".[demo]"``, ``".[bench]"`` or ``".[test]"``.

Layering (``lint-imports``, pyproject's ``[tool.importlinter]``): testkit imports ``controller`` and never
``tests`` or ``bench``; ``controller`` imports none of them.
"""
