"""A short soak in CI: 16 concurrent streams with forced parks every 50 tokens, through kvctl's
proxy, the server in its exact mode; zero lost or duplicated tokens, every id its solo run's, no errors,
no leaked file descriptors or tasks."""

from __future__ import annotations

import argparse

from bench import soak


async def test_short_soak(llama_server_bin: object) -> None:
    args = argparse.Namespace(minutes=0.5, streams=16, n_predict=200, interval=50, via_proxy=True, exact=True)
    tally = await soak.run(args)
    assert tally.streams >= 32, "the soak must run many streams"
    assert tally.errors == [] and tally.lost_or_duplicated == 0
    assert tally.diverged == 0, "--exact: every stream's ids equal its solo run's"
    assert tally.parks >= tally.streams * 3  # every stream was parked several times
    fds = [s[2] for s in tally.samples]
    tasks = [s[3] for s in tally.samples]
    # sampled at rest before and after: nothing left open
    assert fds[-1] <= fds[0] + 2 and tasks[-1] <= tasks[0]
