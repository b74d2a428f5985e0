"""Attention's primal and tangent (issue 30, item 3): the fused Triton kernel against the chunked rule and against
torch's attention forward alone.

Rows, per sequence length and dtype, causal attention over batch x heads like GPT-2 small (8 x 12, head dim 64):

* ``sdpa_forward``: ``F.scaled_dot_product_attention`` alone (flash in bfloat16, memory-efficient in float32): the
  time an inference forward spends in attention, the denominator of every ratio;
* ``chunked_jvp``: the lean rule's chunked path (``fgfw.lean.AttentionJvp``): the forward above, then the tangent
  chunk by chunk of query rows;
* ``fused_jvp``: ``fgfw.triton.attention_jvp``: primal and tangent in one kernel.

float32 rows run with TF32 products (``torch.backends.cuda.matmul.allow_tf32``, ``--no-tf32`` to leave torch's
default): the only float32 path on which the lean engine takes the fused kernel (in IEEE float32 it spills on
sm_90, and takes half a minute to compile).

Each row: the median time of ``--repeats`` calls, its ratio to ``sdpa_forward``, and the peak CUDA memory the call
allocated beyond its inputs. Issue 30's targets: memory linear in the sequence, the attention JVP within 2.5x the
flash forward at sequence 2048.

    python bench/attention_jvp.py --out bench/results/attention_jvp_gpu.csv       # on a GPU
    python bench/attention_jvp.py --device cpu --tiny --out /tmp/attention_jvp.csv  # a dry run (Triton interpreter)
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="batch 1 x 2 heads, length 32, head dim 16, one repeat")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="float32 products in TF32 (torch.backends.cuda.matmul.allow_tf32)")
    parser.add_argument("--out", default="bench/results/attention_jvp_gpu.csv")
    args = parser.parse_args(argv)
    if args.tiny:
        args.lengths, args.batch, args.heads, args.head_dim, args.warmup, args.repeats = [32], 1, 2, 16, 1, 1
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":  # Triton's interpreter is chosen when the kernel is defined: before fgfw.triton loads
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F

    from fgfw import lean
    from fgfw.triton import attention_jvp as kernel

    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def chunked_jvp(q, k, v, q_t, k_t, v_t):
        out = lean.AttentionJvp.forward(q, k, v, None, True, None)
        ctx = lean._Ctx()
        lean.AttentionJvp.setup_context(ctx, (q, k, v, None, True, None), out)
        return out, lean.AttentionJvp.jvp(ctx, q_t, k_t, v_t, None)

    methods = {
        "sdpa_forward": lambda q, k, v, *_: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "chunked_jvp": chunked_jvp,
        "fused_jvp": lambda *x: kernel.attention_jvp(*x, is_causal=True),
    }
    rows = []
    lean._FUSED_ATTENTION_DEVICES.clear()  # chunked_jvp is the chunked rule on every device
    for length in args.lengths:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator(device=device).manual_seed(0)
            shape = (args.batch, args.heads, length, args.head_dim)
            inputs = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(6)]
            base = None
            for name, method in methods.items():
                with torch.no_grad():
                    for _ in range(args.warmup):
                        method(*inputs)
                    sync()
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    held = torch.cuda.memory_allocated() if cuda else 0
                    times = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        result = method(*inputs)
                        sync()
                        times.append((time.perf_counter() - start) * 1e3)
                        del result
                peak = (torch.cuda.max_memory_allocated() - held) / 2**20 if cuda else float("nan")
                ms = statistics.median(times)
                base = ms if name == "sdpa_forward" else base
                rows.append(dict(device=device.type, dtype=dtype_name, batch=args.batch, heads=args.heads,
                                 length=length, head_dim=args.head_dim, method=name, median_ms=f"{ms:.4f}",
                                 x_sdpa_forward=f"{ms / base:.3f}", peak_mib=f"{peak:.1f}",
                                 tf32=bool(torch.backends.cuda.matmul.allow_tf32)))
                print(f"| {dtype_name:8} | {length:5} | {name:12} | {ms:9.3f} ms | {ms / base:6.2f}x | "
                      f"{peak:8.1f} MiB |", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    longest = max(args.lengths)
    for r in rows:
        if r["method"] == "fused_jvp" and r["length"] == longest:
            print(f"target: fused_jvp {r['dtype']} at {longest}: {r['x_sdpa_forward']}x the SDPA forward "
                  f"(issue 30: at most 2.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
