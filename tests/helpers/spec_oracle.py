"""A deliberately naive re-statement of ../shared/spec/LAMEMO_SPEC.md §1-§3, query by query, in float64.

It shares nothing with megamemo.model but the weights: no shifts, no index tricks, positions computed from the
distance of each (query, key) pair. Used to check configurations the golden files do not cover.

Transformer+RPE (variant "rpe", README "The model") is Transformer-XL's layer (§3.1, relative positions with the
u / v biases, clamp_len) without memory: every segment starts from nothing, a query sees the keys of its own
segment up to itself, and nothing is carried to the next segment. same_length then has nothing to equalise
(positions.causal_mask: with no memory it changes nothing; the reference would hide every key)."""

import math

import torch
import torch.nn.functional as F


def sin_emb(dist, d):
    inv = 1.0 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))
    a = float(dist) * inv
    return torch.cat([a.sin(), a.cos()])


def layer_weights(sd, li, n, dh):
    qkv = sd[f"layers.{li}.attn.qkv.weight"].double()
    nd = n * dh

    def g(k):
        return sd[f"layers.{li}.{k}"].double()

    return dict(
        q=qkv[:nd],
        k=qkv[nd : 2 * nd],
        v=qkv[2 * nd :],
        r=g("attn.r_net.weight"),
        o=g("attn.o_net.weight"),
        ln1=(g("attn.layer_norm.weight"), g("attn.layer_norm.bias")),
        w1=g("ff.fc1.weight"),
        b1=g("ff.fc1.bias"),
        w2=g("ff.fc2.weight"),
        b2=g("ff.fc2.bias"),
        ln2=(g("ff.layer_norm.weight"), g("ff.layer_norm.bias")),
    )


def ln(x, wb):
    return F.layer_norm(x, x.shape[-1:], wb[0], wb[1], 1e-5)


def attend(qrow, keys, vals, dists, w, u, vbias, n, dh, d):
    """One query row [B, n*dh] over keys/vals [J, B, n*dh] at the given distances -> (ctx [B,n,dh], lse [B,n])."""
    B = qrow.shape[0]
    q = qrow.view(B, n, dh)
    K = keys.view(-1, B, n, dh)
    R = torch.stack([(w["r"] @ sin_emb(x, d)).view(n, dh) for x in dists])  # [J, n, dh]
    s = torch.einsum("bnd,jbnd->bnj", q + u, K) + torch.einsum("bnd,jnd->bnj", q + vbias, R)
    s = s / math.sqrt(dh)
    lse = torch.logsumexp(s, -1)
    ctx = torch.einsum("bnj,jbnd->bnd", torch.softmax(s, -1), vals.view(-1, B, n, dh))
    return ctx, lse


def ffn(x, w):
    return ln(x + F.linear(F.relu(F.linear(x, w["w1"], w["b1"])), w["w2"], w["b2"]), w["ln2"])


def run_segment(sd, cfg, x, y, mem, mem_len, same_length=False, clamp_len=-1):
    """Returns (nll [L,B], new mem dict). mem: {} or the previous segment's dict (float64 tensors)."""
    n, dh, d = cfg.n_head, cfg.d_head, cfg.d_model
    clamp = (lambda t: min(t, clamp_len)) if clamp_len > 0 else (lambda t: t)
    L, B = x.shape
    emb = sd["word_emb.emb_layers.0.weight"].double()
    h0 = emb[x] * math.sqrt(d)
    u, vp = sd["r_w_bias"].double(), sd["r_r_bias"].double()
    lamemo = cfg.variant.startswith("lamemo")
    if cfg.variant == "rpe":  # no memory: nothing comes in, nothing goes out, same_length is moot
        mem, mem_len, same_length = {}, 0, False
    vf = sd["r_r_bias_future"].double() if cfg.variant == "lamemo" else vp
    M = mem["emb"].shape[0] if lamemo and mem else (mem["hid.0"].shape[0] if mem else 0)
    klen = M + L
    new = {}

    def causal_keys(a):
        js = [j for j in range(a + 1) if not (same_length and klen > mem_len and j <= a - mem_len)]
        return js, [clamp(a - j) for j in js]

    h_mem = mem["emb"] if lamemo and mem else None
    h = h0
    for li in range(cfg.n_layer):
        w = layer_weights(sd, li, n, dh)
        if lamemo:
            cat = torch.cat([h_mem, h]) if M else h
        else:
            cat = torch.cat([mem[f"hid.{li}"], h]) if M else h
            if mem_len:
                new[f"hid.{li}"] = cat[max(0, klen - mem_len) :]
        Q, K, V = cat @ w["q"].T, cat @ w["k"].T, cat @ w["v"].T
        rows, lses = [], []
        for i in range(L):
            js, ds = causal_keys(M + i)
            c, s = attend(Q[M + i], K[js], V[js], ds, w, u, vp, n, dh, d)
            rows.append(c)
            lses.append(s)
        ctx, lse = torch.stack(rows), torch.stack(lses)
        if lamemo and M:
            nk = min(M, L)
            mrows, mlses = [], []
            for i in range(M):
                ps = [p for p in range(M - nk + 1, M + 1) if p > i]
                ds = [clamp(p - i) if cfg.variant != "lamemo_xlrpe" else -(p - i) for p in ps]
                c, s = attend(Q[i], K[ps], V[ps], ds, w, u, vf, n, dh, d)
                mrows.append(c)
                mlses.append(s)
            A, Sm = torch.stack(mrows), torch.stack(mlses)
            Cold, Sold = mem[f"ctx.{li}"], mem[f"lse.{li}"]
            alpha = (Sold.exp() / (Sold.exp() + Sm.exp() + 1e-6)).unsqueeze(-1)
            ctx = torch.cat([alpha * Cold + (1 - alpha) * A, ctx])
            lse = torch.cat([torch.logaddexp(Sold, Sm), lse])
        if lamemo:
            new[f"ctx.{li}"], new[f"lse.{li}"] = ctx[max(0, klen - mem_len) :], lse[max(0, klen - mem_len) :]
        rows_in = cat if lamemo else h
        out = ffn(ln(rows_in + ctx.reshape(ctx.shape[0], B, n * dh) @ w["o"].T, w["ln1"]), w)
        if lamemo:
            h_mem, h = out[:M], out[M:]
        else:
            h = out
    if lamemo:
        e = torch.cat([mem["emb"], h0]) if M else h0
        new["emb"] = e[max(0, klen - mem_len) :]
    logits = h @ emb.T + sd["crit.out_bias"].double()
    nll = -torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return nll, new
