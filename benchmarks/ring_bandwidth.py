#!/usr/bin/env python3
"""Measure the links between MPI ranks the way spmd-cp's ring attention uses them.

    spmd-cp-run -n 2 --hostfile H --exec -- python benchmarks/ring_bandwidth.py [--json]
    spmd-cp-run --netns-cluster --exec -- python benchmarks/ring_bandwidth.py

pass-KV moves K/V blocks around a ring with Sendrecv: every rank sends to rank+1 and
receives from rank-1 at the same time.  So the number that matters is the Sendrecv
bandwidth *per direction* with all links busy, not a one-way ping-pong figure.  With
2 ranks the "ring" is a bidirectional exchange over the one link.

Reported, per message size: seconds per ring step and GB/s per direction (bytes one rank
sends / time, the slowest rank counts).  Then two small-message latencies: a 1-byte
ring Sendrecv step, and half the round trip of a 1-byte ping-pong between ranks 0 and 1.
Received data is checked (a wrong pattern means a broken transport, not a slow one).

With --json, rank 0's last stdout line is one JSON object (hosts, sizes, results).
Run it once on a new cluster: a slow link nobody measured makes every prefill slow.
Needs mpi4py and numpy only.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI


def parse_size(text):
    text = text.strip().upper()
    for suffix, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def human(nbytes):
    for suffix, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{suffix}"
    return f"{nbytes}B"


def ring_step_time(comm, nbytes, iters, warmup):
    """Median-free, slowest-rank time per ring Sendrecv of nbytes (after warmup)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    send = np.full(nbytes, rank % 251, dtype=np.uint8)
    recv = np.empty(nbytes, dtype=np.uint8)
    for _ in range(warmup):
        comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)
    dt = (time.perf_counter() - t0) / iters
    ok = nbytes == 0 or (recv[0] == left % 251 and recv[-1] == left % 251)
    # The ring is as fast as its slowest rank; a bad transfer anywhere fails the run.
    return comm.allreduce(dt, op=MPI.MAX), comm.allreduce(ok, op=MPI.LAND)


def pingpong_half_rtt(comm, iters):
    rank = comm.Get_rank()
    buf = np.zeros(1, dtype=np.uint8)
    comm.Barrier()
    t0 = time.perf_counter()
    if rank in (0, 1):
        peer = 1 - rank
        for _ in range(iters):
            if rank == 0:
                comm.Send(buf, dest=peer)
                comm.Recv(buf, source=peer)
            else:
                comm.Recv(buf, source=peer)
                comm.Send(buf, dest=peer)
    dt = (time.perf_counter() - t0) / iters / 2
    return comm.bcast(dt, root=0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4KB,64KB,1MB,16MB,64MB",
                   help="comma-separated message sizes per ring step (default %(default)s)")
    p.add_argument("--bytes-per-size", default="512MB",
                   help="bytes each rank sends per size; sets the iteration count "
                        "(default %(default)s, at least 3 and at most 2000 iterations)")
    p.add_argument("--latency-iters", type=int, default=2000)
    p.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        if rank == 0:
            print("ring_bandwidth: run with at least 2 ranks", file=sys.stderr)
        return 2
    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    budget = parse_size(args.bytes_per_size)

    results = []
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        iters = max(3, min(2000, budget // max(nbytes, 1)))
        dt, ok = ring_step_time(comm, nbytes, iters, warmup=max(1, iters // 10))
        results.append({"bytes": nbytes, "iters": iters, "step_s": dt,
                        "gb_per_s_per_direction": nbytes / dt / 1e9, "data_ok": bool(ok)})

    lat_ring, _ = ring_step_time(comm, 1, args.latency_iters, warmup=100)
    lat_pp = pingpong_half_rtt(comm, args.latency_iters)

    if rank == 0:
        print(f"ranks: {size}  hosts: {', '.join(hosts)}")
        print(f"{'size':>8} {'iters':>6} {'step':>11} {'GB/s/dir':>9}  data")
        for r in results:
            print(f"{human(r['bytes']):>8} {r['iters']:>6} {r['step_s'] * 1e6:>9.1f}us "
                  f"{r['gb_per_s_per_direction']:>9.3f}  {'ok' if r['data_ok'] else 'BAD'}")
        print(f"latency: 1-byte ring Sendrecv step {lat_ring * 1e6:.1f} us, "
              f"ping-pong half round trip {lat_pp * 1e6:.1f} us")
        if args.json:
            print(json.dumps({"ranks": size, "hosts": hosts, "results": results,
                              "sendrecv_1b_us": lat_ring * 1e6,
                              "pingpong_half_rtt_us": lat_pp * 1e6,
                              "mpi": MPI.Get_library_version().splitlines()[0].strip()}))
    return 0 if all(r["data_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
