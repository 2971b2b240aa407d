"""The client side of scripts/deploy_check.sh: the deployment artifacts, driven as an operator and a client would.

    python -m testkit.deploycheck pod-yaml SRC OUT --server-image IMG     # the pod for a small CPU box
    python -m testkit.deploycheck chat --proxy URL [--api-key KEY]         # one real answer
    python -m testkit.deploycheck burst --proxy URL --admin URL [--during CMD] [--api-key KEY] [--token T]

``burst`` sends concurrent chats that overflow the pool (the openai SDK, streamed, ``ignore_eos``) and
checks that every one gets exactly its ``max_tokens`` and that kvctl parked to get there. ``--during``
runs a command (``systemctl reload kvctl``, ``kvctl drain``) once the chats are a third of the way
through, and checks that it exits 0. The script runs this in the network namespace of the pod or the
systemd machine (``nsenter -n``), where kvctl listens on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["main", "pod_yaml"]

# The pod on a 2-core box with SmolLM2-135M: a pool of 2048 cells, 4 slots, one thread for ggml (its
# spinning threads must not share the cores with kvctl), park budgets that fit the box. The rest of
# the manifest is played as written.
SMALL_BOX_SERVER = {
    "LLAMA_ARG_CTX_SIZE": "2048",
    "LLAMA_ARG_N_PARALLEL": "4",
    "LLAMA_ARG_THREADS": "1",
    "LLAMA_ARG_PARK_RAM": "512",
    "LLAMA_ARG_PARK_DISK_MIB": "1024",
}
SMALL_BOX_KVCTL = {"KVCTL_POLICY__SNAPSHOT_BUDGET_MIB": "512", "KVCTL_PROXY__DRAIN_S": "20"}


def pod_yaml(src: Path, server_image: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The manifest's documents as ``podman kube play`` runs them here, and each change, as ``KIND/NAME PATH``."""
    docs = [d for d in yaml.safe_load_all(src.read_text()) if d]
    changed: list[str] = []

    def change(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        old = node.get(path[-1], "(none)")
        if value is None:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
        where = "/".join(map(str, path))
        changed.append(
            f"{doc['kind']}/{doc['metadata']['name']} {where}: {old} -> {'(removed)' if value is None else value}"
        )

    for doc in docs:
        name = doc["metadata"]["name"]
        if doc["kind"] == "ConfigMap" and name == "llama-server":
            change(doc, ("data", "LLAMA_ARG_N_GPU_LAYERS"), None)  # no GPU
            for key, value in SMALL_BOX_SERVER.items():
                change(doc, ("data", key), value)
        elif doc["kind"] == "ConfigMap" and name == "kvctl":
            for key, value in SMALL_BOX_KVCTL.items():
                change(doc, ("data", key), value)
        elif doc["kind"] == "Deployment":
            change(doc, ("spec", "replicas"), 1)  # one pod on this box
            for i, c in enumerate(doc["spec"]["template"]["spec"]["containers"]):
                at = ("spec", "template", "spec", "containers", i)
                for section in ("requests", "limits"):
                    if "nvidia.com/gpu" in c.get("resources", {}).get(section, {}):
                        change(doc, (*at, "resources", section, "nvidia.com/gpu"), None)
                if c["name"] == "llama-server":
                    change(doc, (*at, "image"), server_image)  # the CPU build
                    # podman applies limits only, but 24 GiB of requests would not fit this box anyway
                    change(doc, (*at, "resources", "requests", "memory"), "2Gi")
    return docs, changed


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _metric(session: aiohttp.ClientSession, url: str, prefix: str, token: str | None) -> float:
    async with session.get(url + "/metrics", headers=_auth(token)) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith(prefix))


class _Progress:
    """Tokens received by every chat together; ``third`` is set once they reach a third of the burst."""

    def __init__(self, total: int) -> None:
        self.tokens, self.total, self.third = 0, total, asyncio.Event()

    def add(self) -> None:
        self.tokens += 1
        if self.tokens * 3 >= self.total:
            self.third.set()


async def burst(args: argparse.Namespace) -> int:
    import openai  # here, not at the top: pod_yaml is for the unit tests too, which run without it

    from testkit.demo import chat as chat_stream

    client = openai.AsyncOpenAI(base_url=args.proxy + "/v1", api_key=args.api_key or "none", timeout=900)
    async with aiohttp.ClientSession() as s:
        parks0 = await _metric(s, args.admin, "kvctl_parks_total", args.token)
        progress = _Progress(args.chats * args.tokens)
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(chat_stream(client, i, args.tokens, progress.add)) for i in range(args.chats)]
        during_rc = None
        if args.during:
            await asyncio.wait([asyncio.ensure_future(progress.third.wait()), *tasks], return_when="FIRST_COMPLETED")
            print(f"deploycheck: at {progress.tokens} tokens, running: {args.during}", flush=True)
            proc = await asyncio.create_subprocess_exec(*shlex.split(args.during))
            during_rc = await proc.wait()
            print(f"deploycheck: {args.during!r} exited {during_rc} after {time.monotonic() - t0:.1f} s", flush=True)
        results = await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
        parks = await _metric(s, args.admin, "kvctl_parks_total", args.token) - parks0 if not args.no_after else -1
    await client.close()
    for i, (_, n, err) in enumerate(results):
        print(f"  chat {i}: {n}/{args.tokens} tokens{(' - ' + err) if err else ''}")
    complete = sum(ok for ok, _, _ in results)
    print(f"deploycheck: {complete}/{args.chats} chats whole in {wall:.1f} s, {parks:.0f} parks by kvctl", flush=True)
    ok = complete == args.chats and (args.no_after or parks >= args.min_parks) and during_rc in (None, 0)
    return 0 if ok else 1


async def chat(args: argparse.Namespace) -> int:
    import openai

    client = openai.AsyncOpenAI(base_url=args.proxy + "/v1", api_key=args.api_key or "none", timeout=300)
    answer = await client.chat.completions.create(
        model="kvctl",
        # SmolLM2-135M answers a bare question with noise; with a system turn it answers it
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=48,
        temperature=0,
    )
    await client.close()
    text = (answer.choices[0].message.content or "").strip()
    print(f"deploycheck: answer: {text!r}")
    return 0 if "Paris" in text else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testkit.deploycheck", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pod-yaml")
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--server-image", required=True)
    for name in ("chat", "burst"):
        q = sub.add_parser(name)
        q.add_argument("--proxy", required=True)
        q.add_argument("--api-key", default=os.environ.get("KVCTL_CHECK_API_KEY"), help="default: $KVCTL_CHECK_API_KEY")
        if name == "burst":
            q.add_argument("--admin", required=True)
            q.add_argument(
                "--token", default=os.environ.get("KVCTL_CHECK_TOKEN"), help="admin token ($KVCTL_CHECK_TOKEN)"
            )
            q.add_argument("--chats", type=int, default=4)
            q.add_argument("--tokens", type=int, default=640)
            q.add_argument("--min-parks", type=int, default=1)
            q.add_argument("--during", help="a command to run a third of the way through")
            q.add_argument("--no-after", action="store_true", help="kvctl is gone after --during: no metrics")
    args = ap.parse_args(argv)
    if args.cmd == "pod-yaml":
        docs, changed = pod_yaml(args.src, args.server_image)
        args.out.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        print(json.dumps(changed, indent=1))
        return 0
    return asyncio.run(chat(args) if args.cmd == "chat" else burst(args))


if __name__ == "__main__":
    sys.exit(main())
