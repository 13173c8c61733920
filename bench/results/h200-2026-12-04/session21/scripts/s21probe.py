# session 21: padmoe.torch at decode in one graph (20 calls captured, one replay / 20):
# dispatch with and without the padding rows written, and plan + dispatch + combine both ways;
# GroupedExperts forward under no_grad (padding unwritten) beside the op sequence it runs.
import statistics, torch
import padmoe.torch as pt
T, E, K, H, align = 256, 256, 8, 7168, 16
torch.manual_seed(0)
logits = torch.randn(T, E, device="cuda")
w, top = torch.topk(torch.softmax(logits, -1), K, dim=-1)
top = top.int().contiguous(); w = w.float().contiguous()
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
plan = pt.make_plan(top, E, align, check=False)
y = pt.dispatch(x, plan, check=False)
def in_graph(fn, n=20, reps=30):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    for _ in range(3): g.replay()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(ts)
with torch.no_grad():
    for zp in (True, False):
        print(f"dispatch zero_padding={zp}: {in_graph(lambda: pt.dispatch(x, plan, check=False, zero_padding=zp)):.1f} us")
    for zp in (True, False):
        def pdc():
            p = pt.make_plan(top, E, align, check=False)
            yy = pt.dispatch(x, p, check=False, zero_padding=zp)
            return pt.combine(yy, p, w, check=False)
        print(f"make_plan + dispatch(zero_padding={zp}) + combine(w): {in_graph(pdc):.1f} us")
    print(f"combine(w): {in_graph(lambda: pt.combine(y, plan, w, check=False)):.1f} us")
    print(f"make_plan: {in_graph(lambda: pt.make_plan(top, E, align, check=False)):.1f} us")
