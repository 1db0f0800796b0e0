"""Times the all-reduce of a TP decode step on two GPUs: NCCL's against torch's symmetric-memory
one-shot all-reduce (peer loads over NVLink, no multicast), each 64 times inside one CUDA graph
(two a layer, 32 layers), for the activations of B tokens of hidden size H in bf16; checks that
both give the same sums. Run: ``python tools/tp_allreduce_lab.py [--batch 64] [--hidden 4096]``
on a machine with two GPUs (multicast stays off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1)."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _rank(rank: int, world: int, port: int, batch: int, hidden: int, calls: int, out) -> None:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16) * (rank + 1)
    res = {}

    def timed(fn, name):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        dist.barrier()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        times = []
        for _ in range(20):
            ev[0].record()
            g.replay()
            ev[1].record()
            torch.cuda.synchronize()
            times.append(ev[0].elapsed_time(ev[1]) * 1e3 / calls)
        times.sort()
        res[name] = {"us_per_call_median": times[len(times) // 2], "us_min": times[0]}

    buf = x.clone()

    def nccl():
        buf.copy_(x)
        dist.all_reduce(buf, group=group)
    timed(nccl, "nccl")
    want = buf.clone()
    try:
        import torch.distributed._symmetric_memory as symm_mem
        sbuf = symm_mem.empty(batch, hidden, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(sbuf, group.group_name)
        got = {}

        def one_shot():
            sbuf.copy_(x)
            got["o"] = torch.ops.symm_mem.one_shot_all_reduce(sbuf, "sum", group.group_name)
        timed(one_shot, "symm_one_shot")
        res["symm_one_shot_equal"] = bool(torch.equal(got["o"], want))
        res["symm_one_shot_maxdiff"] = float((got["o"].float() - want.float()).abs().max())

        def two_shot():
            sbuf.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(sbuf, "sum", group.group_name)
        timed(two_shot, "symm_two_shot")
        res["symm_two_shot_maxdiff"] = float((sbuf.float() - want.float()).abs().max())
    except Exception as e:          # noqa: BLE001 - report what failed, keep NCCL's numbers
        res["symm_error"] = f"{type(e).__name__}: {e}"[:500]

    def copy_only():
        buf.copy_(x)
    timed(copy_only, "copy_only")
    out[rank] = res
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import json
    import socket

    import torch.multiprocessing as mp
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--calls", type=int, default=64)
    a = p.parse_args()
    for batch in a.batch:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.Manager().dict()
        mp.spawn(_rank, args=(2, port, batch, a.hidden, a.calls, out), nprocs=2, join=True)
        print(json.dumps({"batch": batch, "hidden": a.hidden, "bytes": batch * a.hidden * 2,
                          "rank0": out[0], "rank1": out[1]}))


if __name__ == "__main__":
    main()
