"""A transformers MoE block with padmoe's experts against transformers' own experts implementations.

The block is transformers' ``MixtralSparseMoeBlock`` (router, top-k, experts) of a tiny random
Mixtral config (``from_config``, seeded: nothing downloaded), by default a mid-sized MoE layer: T=4096
tokens, H=1024, E=16 experts, K=2, bfloat16, with an expert intermediate size I=2048 (``--ffn``). The experts
implementation is switched with ``model.set_experts_implementation(name)`` for each of:

- ``padmoe``        padmoe's Routing + grouped GEMMs (padmoe.integrations.transformers)
- ``eager``         transformers' per-expert Python loop
- ``grouped_mm``    transformers' sort + ``grouped_mm`` implementation
- ``batched_mm``    transformers' per-assignment batched matmul (only with --batched: it materializes
                    a weight copy per assignment, T*K*3*H*I elements)

Timing: forward (no grad) and forward + backward (grad of the input and every parameter), eager
mode, ``--iters`` iterations after ``--warmup``, the loop bracketed by ``torch.cuda.synchronize()``
on CUDA; the mean per iteration is reported. Each implementation's output is also checked against
eager's (max |diff| / max |eager|) so a broken one does not post a time.

    python bench/bench_transformers.py                      # CUDA if present, else CPU; the default size
    python bench/bench_transformers.py --device cpu --tokens 1024 --iters 3
    python bench/bench_transformers.py --markdown out.md    # also write a markdown table

padmoe options: ``--alignment`` (default 16 on CUDA, 1 on the CPU); ``--no-check`` turns padmoe's
CUDA data checks (one synchronization per op) off, as a training loop would.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import torch


def build(args):
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=128,
    )
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    dtype = getattr(torch, args.dtype)
    model = model.to(args.device, dtype).train()
    block = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(args.device, dtype)
    return model, block, x


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_it(fn, device, iters, warmup):
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def run(args):
    import transformers
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import padmoe.integrations.transformers as ptf

    ptf.register(alignment=args.alignment, check=False if args.no_check else None)
    model, block, x = build(args)
    available = sorted(set(ALL_EXPERTS_FUNCTIONS.keys()) | {"eager"})
    impls = ["padmoe", "grouped_mm", "eager"] + (["batched_mm"] if args.batched else [])
    impls = [i for i in impls if i in available]

    def fwd():
        with torch.no_grad():
            return block(x)

    xg = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn_like(x)

    def fwd_bwd():
        for p in block.parameters():
            p.grad = None
        xg.grad = None
        out = block(xg)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_out)

    model.set_experts_implementation("eager")
    ref = fwd()
    ref = ref[0] if isinstance(ref, tuple) else ref
    rows = []
    for impl in impls:
        try:
            model.set_experts_implementation(impl)
            out = fwd()
            out = out[0] if isinstance(out, tuple) else out
            diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t_f = time_it(fwd, args.device, args.iters, args.warmup)
            t_fb = time_it(fwd_bwd, args.device, args.iters, args.warmup)
            rows.append((impl, t_f, t_fb, diff, ""))
        except Exception as e:  # noqa: BLE001 (report, go on)
            rows.append((impl, None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
        print(_fmt(rows[-1], rows), flush=True)
    return rows, available, transformers.__version__


def _fmt(row, rows):
    impl, t_f, t_fb, diff, err = row
    if t_f is None:
        return f"{impl:12s} failed: {err}"
    return f"{impl:12s} fwd {t_f * 1e3:9.3f} ms   fwd+bwd {t_fb * 1e3:9.3f} ms   max|diff|/max|eager| {diff:.2e}"


def device_name(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def markdown(args, rows, available, tf_version):
    base = {r[0]: r for r in rows if r[1] is not None}
    lines = [
        f"# transformers MoE block: padmoe vs transformers' experts ({args.device}, {datetime.date.today()})",
        "",
        f"`python bench/bench_transformers.py {' '.join(sys.argv[1:])}`",
        "",
        f"- block: `MixtralSparseMoeBlock`, T={args.tokens}, H={args.hidden}, I={args.ffn}, E={args.experts}, "
        f"K={args.top_k}, {args.dtype}; mean of {args.iters} iterations after {args.warmup} warmup, eager mode",
        f"- device: {device_name(args.device)}; torch {torch.__version__}; transformers {tf_version}",
        f"- experts implementations registered: {', '.join(available)}",
        f"- padmoe alignment: {args.alignment or ('16' if args.device.startswith('cuda') else '1')}"
        f"{'; data checks off' if args.no_check else ''}",
        "",
        "| experts implementation | forward ms | fwd + bwd ms | fwd vs padmoe | fwd+bwd vs padmoe | max abs diff / max abs eager |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    p = base.get("padmoe")
    for impl, t_f, t_fb, diff, err in rows:
        if t_f is None:
            lines.append(f"| {impl} | failed: {err} | | | | |")
            continue
        rf = f"{t_f / p[1]:.2f}x" if p else ""
        rfb = f"{t_fb / p[2]:.2f}x" if p else ""
        lines.append(f"| {impl} | {t_f * 1e3:.3f} | {t_fb * 1e3:.3f} | {rf} | {rfb} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2048, help="expert intermediate size I")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--alignment", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batched", action="store_true", help="also time transformers' batched_mm (memory hungry)")
    ap.add_argument("--no-check", action="store_true", help="no padmoe data checks (check=False)")
    ap.add_argument("--markdown", default=None, help="write the results as a markdown table to this file")
    args = ap.parse_args(argv)
    print(
        f"MixtralSparseMoeBlock T={args.tokens} H={args.hidden} I={args.ffn} E={args.experts} K={args.top_k} "
        f"{args.dtype} on {args.device} ({device_name(args.device)}), torch {torch.__version__}"
    )
    rows, available, tf_version = run(args)
    print(f"experts implementations registered: {', '.join(available)}")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(args, rows, available, tf_version))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
