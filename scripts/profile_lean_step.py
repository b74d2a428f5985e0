"""torch.profiler table of one lean AFGFW step (K = 1, the README's groups) on Hugging Face GPT-2 (issue 30: is the
forward-gradient step host-bound, and which ops take the device's time?).

    python scripts/profile_lean_step.py --device cuda            # GPT-2 small, batch 8 x 512, float32
    python scripts/profile_lean_step.py --device cuda --tf32     # the same with TF32 products
    python scripts/profile_lean_step.py --device cpu --tiny      # 2 x 64, batch 2 x 32: the CPU stand-in (CI)

Two warm-up steps, then one profiled step. Prints the step's wall time, the host's op time, the device's kernel
time and the number of kernel launches, then the ops that took the most device time (host time on the CPU).
``--out`` also writes the table to a file.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fgfw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide GPT-2 and a 2 x 32 batch")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tf32", action="store_true",
                        help="float32 products as TF32 (torch.backends.cuda.matmul.allow_tf32): cuBLAS's tensor-core "
                             "kernels instead of SIMT sgemm, and the fused attention JVP's float32 path")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    from transformers import GPT2Config, GPT2LMHeadModel

    device = torch.device(args.device)
    size = (dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64) if args.tiny else
            dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024))
    batch, length = (2, 32) if args.tiny else (8, 512)
    torch.manual_seed(0)
    with device:
        model = GPT2LMHeadModel(GPT2Config(**size, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0))
    tokens = torch.randint(0, size["vocab_size"], (batch, length), device=device)

    def closure():
        return model(tokens, labels=tokens).loss

    groups = fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(5.0, scope="row"), biases=None,
                               norms={"constraint": None, "step_size": 1e-3},
                               embeddings=fgfw.LInfBall.relative_to_init(2.0))
    opt = fgfw.AFGFW(model, params=groups, constraint=fgfw.L1Ball(radius=1.0), seed=0, engine="lean")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        opt.step(closure)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        begin = time.perf_counter()
        opt.step(closure)
        sync()
        wall = time.perf_counter() - begin
    events = prof.key_averages()
    host_ms = sum(e.self_cpu_time_total for e in events) / 1e3
    device_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    name = "GPT-2 2 x 64, batch 2 x 32" if args.tiny else "GPT-2 small, batch 8 x 512"
    lines = [f"lean AFGFW step, K = 1, {name}, float32{' (TF32 products)' if args.tf32 else ''}, {device} "
             f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}",
             f"wall {1e3 * wall:.1f} ms; host op time {host_ms:.1f} ms; device kernel time {device_ms:.1f} ms; "
             f"{launches} kernel launches; {ops} aten op calls"]
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    lines.append(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
