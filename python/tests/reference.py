"""Independent reference for the padmoe Python tests: plain loops over numpy
arrays in float64 (plus a float32 ascending-k loop for the bitwise checks).
Written from docs/spec.md, never calling padmoe."""

import numpy as np


def round_up(n, m):
    return (n + m - 1) // m * m


def make_plan(top_experts, num_experts, alignment):
    """docs/spec.md §3: a dict of the plan arrays (int64) and P."""
    top = np.asarray(top_experts)
    t, k = top.shape
    a_count = t * k
    flat = [int(top[a // k, a % k]) for a in range(a_count)]
    counts = [0] * num_experts
    for e in flat:
        counts[e] += 1
    # stable counting sort by expert
    indices = []
    for e in range(num_experts):
        for a in range(a_count):
            if flat[a] == e:
                indices.append(a)
    bin_ids = [flat[a] for a in indices]
    bins, padded_counts, padded_bins = [], [], []
    run = prun = 0
    for e in range(num_experts):
        run += counts[e]
        bins.append(run)
        pc = round_up(counts[e], alignment)
        padded_counts.append(pc)
        prun += pc
        padded_bins.append(prun)
    p = prun
    dest_rows = [0] * a_count
    row_sources = [-1] * p
    for i, a in enumerate(indices):
        e = bin_ids[i]
        real_start = 0 if e == 0 else bins[e - 1]
        padded_start = 0 if e == 0 else padded_bins[e - 1]
        row = padded_start + i - real_start
        dest_rows[a] = row
        row_sources[row] = a

    def arr(v):
        return np.array(v, dtype=np.int64)

    return {
        "indices": arr(indices),
        "bin_ids": arr(bin_ids),
        "tokens_per_expert": arr(counts),
        "bins": arr(bins),
        "padded_tokens_per_expert": arr(padded_counts),
        "padded_bins": arr(padded_bins),
        "dest_rows": arr(dest_rows),
        "row_sources": arr(row_sources),
        "P": p,
        "top_k": k,
        "num_tokens": t,
    }


def _w(weights, a):
    return 1.0 if weights is None else float(weights[a])


def gather(x, plan, weights=None):
    """y[P, H] in float64: y[dest_rows[a]] = x[a // K] * w(a); padding rows zero."""
    x = np.asarray(x, dtype=np.float64)
    k = plan["top_k"]
    y = np.zeros((plan["P"], x.shape[1]), dtype=np.float64)
    for a, row in enumerate(plan["dest_rows"]):
        for h in range(x.shape[1]):
            y[row, h] = x[a // k, h] * _w(weights, a)
    return y


def scatter(y, plan, weights=None):
    """out[T, H] in float64: out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]]."""
    y = np.asarray(y, dtype=np.float64)
    k, t_count = plan["top_k"], plan["num_tokens"]
    out = np.zeros((t_count, y.shape[1]), dtype=np.float64)
    for t in range(t_count):
        for kk in range(k):
            a = t * k + kk
            for h in range(y.shape[1]):
                out[t, h] += _w(weights, a) * y[plan["dest_rows"][a], h]
    return out


def scatter_f32(y, plan, weights=None):
    """padded_scatter as padmoe computes it: float32 products and sums in
    ascending k (each operation rounded to float32), not yet cast."""
    y32 = np.asarray(y).astype(np.float32)
    w32 = None if weights is None else np.asarray(weights).astype(np.float32)
    k, t_count = plan["top_k"], plan["num_tokens"]
    out = np.zeros((t_count, y32.shape[1]), dtype=np.float32)
    for t in range(t_count):
        acc = np.zeros(y32.shape[1], dtype=np.float32)
        for kk in range(k):
            a = t * k + kk
            row = y32[plan["dest_rows"][a]]
            acc = acc + (row if w32 is None else w32[a] * row)
        out[t] = acc
    return out


def gather_f32(x, plan, weights):
    """padded_gather with weights as padmoe computes it: one float32 product."""
    x32 = np.asarray(x).astype(np.float32)
    w32 = np.asarray(weights).astype(np.float32)
    k = plan["top_k"]
    y = np.zeros((plan["P"], x32.shape[1]), dtype=np.float32)
    for a, row in enumerate(plan["dest_rows"]):
        y[row] = x32[a // k] * w32[a]
    return y


def wgrad(y, grad, plan):
    """wgrad[a] = sum_h y[dest_rows[a], h] * grad[a // K, h] in float64."""
    y = np.asarray(y, dtype=np.float64)
    grad = np.asarray(grad, dtype=np.float64)
    k = plan["top_k"]
    out = np.zeros(len(plan["dest_rows"]), dtype=np.float64)
    for a, row in enumerate(plan["dest_rows"]):
        s = 0.0
        for h in range(y.shape[1]):
            s += y[row, h] * grad[a // k, h]
        out[a] = s
    return out


def pad(hidden, counts, alignment):
    """(padded[P, H] float64, permutation_map[P], inclusive_offsets[E])."""
    hidden = np.asarray(hidden, dtype=np.float64)
    counts = [int(c) for c in counts]
    p = sum(round_up(c, alignment) for c in counts)
    padded = np.zeros((p, hidden.shape[1]), dtype=np.float64)
    pmap = np.full(p, -1, dtype=np.int64)
    offsets = []
    src = dst = 0
    for c in counts:
        for i in range(c):
            padded[dst + i] = hidden[src + i]
            pmap[dst + i] = src + i
        src += c
        dst += round_up(c, alignment)
        offsets.append(dst)
    return padded, pmap, np.array(offsets, dtype=np.int64)


def unpad(padded, pmap, n, probs=None):
    """out[N, H] float64: out[map[p]] = padded[p] * probs[map[p]]; other rows zero."""
    padded = np.asarray(padded, dtype=np.float64)
    out = np.zeros((n, padded.shape[1]), dtype=np.float64)
    for p, src in enumerate(pmap):
        if src >= 0:
            for h in range(padded.shape[1]):
                out[src, h] = padded[p, h] * (1.0 if probs is None else float(probs[src]))
    return out


def unpad_backward(grad_out, padded, pmap, probs=None):
    """(grad_padded, grad_probs or None) in float64."""
    grad_out = np.asarray(grad_out, dtype=np.float64)
    padded = np.asarray(padded, dtype=np.float64)
    grad_padded = np.zeros(padded.shape, dtype=np.float64)
    grad_probs = None if probs is None else np.zeros(grad_out.shape[0], dtype=np.float64)
    for p, src in enumerate(pmap):
        if src >= 0:
            scale = 1.0 if probs is None else float(probs[src])
            for h in range(padded.shape[1]):
                grad_padded[p, h] = grad_out[src, h] * scale
            if grad_probs is not None:
                grad_probs[src] = sum(grad_out[src, h] * padded[p, h] for h in range(padded.shape[1]))
    return grad_padded, grad_probs
