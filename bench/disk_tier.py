"""The disk tier against recompute: what a park to disk and a resume from it cost, beside a recompute resume.

    python -m bench.disk_tier [--model smollm2|kvheavy|bench] [--cells 1024,2048,...] [--repeat 3] [--dir DIR]

First the disk's own sequential rates under DIR (dd, 1 GiB, O_DIRECT, fdatasync). Then one server with
--park-ram 0 --park-disk DIR (no RAM for snapshots: every swap park is a file) parks and resumes a
generating request of each length through the API, and parks and resumes the same request by recompute:
  disk       the server's park_ms (sliced copy into the file, then written back and its pages dropped) and
             resume_ms (read back whole against its checksum, then copied back in slices), with the bytes
             per second each makes of the snapshot, against dd's;
  recompute  the resume until the stream's next token (the server answers at once, evaluates the tokens
             again, then decodes one step), on the same request after its disk rounds (one prefill a length).
The last column is how many times longer a recompute resume takes than a resume from disk. Recompute rows
above 4096 cells are measured once (a CPU prefill of 32k tokens takes minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import build, cli, model, save, server, table
from bench.park_cost import first_token, long_request
from testkit.llama import post_action

MiB = 1 << 20
Rounds = tuple[list[float], list[float], list[float], int]


def dd_rates(directory: Path, n_mib: int = 1024) -> tuple[float, float]:
    """Sequential write and read of n_mib under directory in GB/s, past the page cache (O_DIRECT)."""
    path = directory / "dd-rate.bin"
    try:
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={n_mib // 16}", "oflag=direct", "conv=fdatasync"],
            check=True,
            capture_output=True,
        )
        write = n_mib * MiB / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
        read = n_mib * MiB / (time.perf_counter() - t0) / 1e9
    finally:
        path.unlink(missing_ok=True)
    return write, read


async def until_parked(resp: aiohttp.ClientResponse) -> None:
    """Read the stream up to the park's notice (the tokens streamed before it come first)."""
    while (line := await resp.content.readline()) != b": parked\n":
        if not line:
            raise RuntimeError("the stream ended before the park")


async def measure(url: str, n_cells: int, repeat: int, rc_repeat: int) -> Rounds:
    """On one request of n_cells (one prefill: at 32k tokens a CPU prefill takes many minutes): repeat disk parks and
    resumes (the server's park_ms and resume_ms), then rc_repeat recompute parks and resumes until the next token
    (client side)."""
    park_ms, resume_ms, rc_ms, n_bytes = [], [], [], 0
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout) as s:
        async with s.post(url + "/completion", json=long_request(n_cells, stream=True)) as resp:
            await first_token(resp)
            for _ in range(repeat):
                st, b, _ = await post_action(s, url, 0, "park", {"tier": "disk"})
                assert st == 200 and b["tier"] == "disk", b
                park_ms.append(b["timings"]["park_ms"])
                n_bytes = b["n_bytes"]
                await until_parked(resp)
                st, b, _ = await post_action(s, url, 0, "resume")
                assert st == 200 and b["tier"] == "disk", b
                resume_ms.append(b["timings"]["resume_ms"])
                await first_token(resp)
            for _ in range(rc_repeat):
                st, b, _ = await post_action(s, url, 0, "park", {"mode": "recompute"})
                assert st == 200 and b["mode"] == "recompute", b
                await until_parked(resp)
                t0 = time.perf_counter()
                st, b, _ = await post_action(s, url, 0, "resume")
                assert st == 200, b
                await first_token(resp)  # ": resumed", keep-alives, blank lines
                rc_ms.append((time.perf_counter() - t0) * 1e3)
            resp.close()
    return park_ms, resume_ms, rc_ms, n_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "kvheavy", "bench"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cells", default="", help="request lengths (default: up to what the model's context takes)")
    ap.add_argument("--dir", default="/var/tmp", help="where the disk tier's directory goes (a local disk)")
    ap.add_argument("--out", default="", help="name of the table in bench/results/ (default disk_tier-MODEL)")
    args = ap.parse_args(argv)
    # SmolLM2 is trained on 8192 tokens: longer requests run past it (RoPE extrapolated: the text degrades, the
    # cost of its cells does not); the random-weight models take 32768
    default = {"smollm2": "1024,4096,8000,16384,32000", "kvheavy": "1024,4096,16384"}.get(
        args.model, "1024,4096,16384,32000"
    )
    cells = [int(c) for c in (args.cells or default).split(",")]
    binary = build()
    gguf = model(args.model, binary)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvctl-park-", dir=args.dir) as tmp:
        directory = Path(tmp)
        dd_write, dd_read = dd_rates(directory)
        print(f"dd under {args.dir}: write {dd_write:.2f} GB/s, read {dd_read:.2f} GB/s (O_DIRECT, 1 GiB)")
        fs = subprocess.run(["df", "--output=source,fstype", str(directory)], capture_output=True, text=True).stdout
        n_ctx = str(max(cells) + 512)
        args_srv: tuple[str, ...] = ("-c", n_ctx, "-np", "1", "-kvu", "--slots", "-fa", "on", "-b", "2048")
        if args.model == "smollm2" and max(cells) > 8192:
            # past its training context, which the server caps a slot to: the text degrades, the cost does not
            args_srv += ("--override-kv", f"llama.context_length=int:{n_ctx}")
        # --park-lease 0: a park of gigabytes outlasts the lease, and the server would resume it on its own
        disk = ("--park-ram", "0", "--park-disk", str(directory), "--park-disk-mib", "16384", "--park-lease", "0")
        with server(binary, gguf, *args_srv, *disk) as srv:
            for n_cells in cells:
                rc_repeat = args.repeat if n_cells <= 4096 else 1
                park, resume, rc_resume, n_bytes = asyncio.run(measure(srv.url, n_cells, args.repeat, rc_repeat))
                p50_park, p50_resume, p50_rc = (
                    statistics.median(park),
                    statistics.median(resume),
                    statistics.median(rc_resume),
                )
                rows.append(
                    (
                        n_cells,
                        n_bytes / MiB,
                        p50_park,
                        n_bytes / (p50_park / 1e3) / 1e9,
                        p50_resume,
                        n_bytes / (p50_resume / 1e3) / 1e9,
                        p50_rc,
                        p50_rc / p50_resume,
                    )
                )
                print(rows[-1], flush=True)
    out = table(
        [
            "cells",
            "snapshot MiB",
            "disk park p50 ms",
            "park GB/s",
            "disk resume p50 ms",
            "resume GB/s",
            "recompute resume p50 ms",
            "recompute / disk resume",
        ],
        rows,
    )
    source = re.sub(r"\s+", " ", fs.splitlines()[-1]).strip() if fs else "?"
    head = (
        f"model: {args.model} ({gguf.name}), -fa on, CPU, --park-ram 0, the disk tier under {args.dir} ({source})\n"
        f"dd on the same file system: write {dd_write:.2f} GB/s, read {dd_read:.2f} GB/s (1 GiB, O_DIRECT)\n\n"
    )
    print(head + out)
    save(f"{args.out or 'disk_tier-' + args.model}.md", head + out + "\n")
    return 0


if __name__ == "__main__":
    cli(main)
