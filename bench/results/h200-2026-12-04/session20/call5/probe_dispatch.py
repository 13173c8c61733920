# session 20: why PM.dispatch's single eager call at deepseek-v3 is ~95 us over its graph replay (34 on 12-01)
import statistics, sys, torch
from torch.profiler import profile, ProfilerActivity
import padmoe as PM
T, E, K, H, align = 16384, 256, 8, 7168, 128
torch.manual_seed(0)
logits = torch.randn(T, E, device="cuda")
w, top = torch.topk(torch.softmax(logits, -1), K, dim=-1)
top2d = top.int().contiguous()
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
plan = PM.Plan.empty(T, K, E, align, like=top2d)
ws = torch.empty(max(PM.workspace_bound(T, K, E, align), 1), dtype=torch.uint8, device="cuda")
PM.make_plan(top2d, E, align, out=plan, check=False, workspace=ws)
yb = torch.empty(plan.capacity, H, device="cuda", dtype=x.dtype)
def ev(fn, reps=30, pre=None):
    ts = []
    for _ in range(5): fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        if pre: pre()
        torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)
disp = lambda: PM.dispatch(x, plan, out=yb, check=False, workspace=ws)
print("eager dispatch", ev(disp))
print("eager dispatch again", ev(disp))
print("eager dispatch, make_plan before each (untimed)", ev(disp, pre=lambda: PM.make_plan(top2d, E, align, out=plan, check=False, workspace=ws)))
empty = torch.empty(1, device="cuda")
print("eager dispatch, a tiny kernel before each (untimed)", ev(disp, pre=lambda: empty.add_(1)))
def host():
    import time
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(20): disp()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    return (t1 - t0) / 20 * 1e6
print("host us per call (20 queued)", host())
for tag in ("eager", "back-to-back"):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            disp()
            if tag == "eager": torch.cuda.synchronize()
        torch.cuda.synchronize()
    ks = [(e.name[:70], e.time_range.elapsed_us()) for e in prof.events() if "CUDA" in str(getattr(e, "device_type", ""))]
    names = {}
    for n, us in ks: names.setdefault(n, []).append(us)
    for n, v in names.items(): print(tag, f"{len(v)}x", f"median {statistics.median(v):.1f} us", n)
