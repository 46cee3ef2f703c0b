"""megamemo/plan/steptime.py's predicted step against arithmetic written out here, the ranking it gives `megamemo plan`,
and the plan command's one-line answers to input it cannot use."""

from __future__ import annotations

import math

import pytest
from helpers.errors import one_line_error
from helpers.fixture_data import REPO

from megamemo.commands.plan import main
from megamemo.plan.devices import Device
from megamemo.plan.layouts import plan
from megamemo.plan.optrace import trace
from megamemo.plan.steptime import explain, step_time
from megamemo.train import config

# Tolerances here: pytest.approx (default rel 1e-6) and rel=1e-12 compare float64 evaluations of the same formula
# (IEEE arithmetic, rounded alike on any CPU; numpy's sums in another order at most): they differ by a few u64
# (1.1e-16) relative, so either tolerance only says 'the same number'. Nothing here depends on a CPU's kernels.


def load(path, overrides=()):
    """A config as `megamemo plan` reads it before any data exists: the large configs' `model.n_token: auto` taken
    as the shipped tokenizer's 32,000 symbols (plan --vocab's default), padded for the layout's tp."""
    return config.load(path, overrides, vocab_fallback=32000)


# a device with round numbers: 1 TFLOP/s; GEMM efficiency 50% at width 16, 100% from 64 (log-interpolated);
# 100 GB/s memory; links 10 GB/s inside a node, 1 GB/s between; 10 / 100 us a collective
TOY = Device(
    "toy", {"fp32": 1e12}, ((16, 0.5), (64, 1.0)), mem_bw=1e11, link=(1e10, 1e9), latency=(1e-5, 1e-4), source="test"
)
TINY = REPO / "configs" / "tiny-cpu.yaml"

# the shipped 1.3b and 7b configs overlap their reduction in buckets of 5e7: DeepSpeed's defaults back, for the
# tests that price its 5e8 buckets or choose a layout (ZeRO 0, a pipeline) where overlap cannot apply
DS_DEFAULTS = ["parallel.overlap_comm=false", "parallel.reduce_bucket_size=null"]


def rpe(*overrides):
    """tiny-cpu as RPE (no memory): 4 layers, d 64, 2 x 32 heads, d_inner 128, L 32, bytes, 8 streams, fp32."""
    return load(TINY, ["model.variant=rpe", "model.n_layer=4", "eval.every=0", *overrides])


def rpe_forward_flops(B, layers=4, L=32, d=64, H=64, F=128, V=256):
    """Forward FLOPs by hand: per layer q (L rows), k and v, r_net over L distances, scores + position scores +
    weighted values, o_net, the two FFN products; then the output layer."""
    per_layer = (
        2 * L * d * H * B
        + 2 * L * d * 2 * H * B
        + 2 * L * d * H
        + 3 * 2 * L * L * H * B
        + 2 * L * H * d * B
        + 2 * L * 2 * d * F * B
    )
    return layers * per_layer + 2 * L * B * d * V


def test_efficiency_is_interpolated_in_log_width():
    assert TOY.eff(16) == 0.5 and TOY.eff(64) == 1.0 and TOY.eff(4096) == 1.0
    assert TOY.eff(32) == pytest.approx(0.75)  # halfway in log2 between 16 and 64
    assert TOY.eff(8) == pytest.approx(0.25)  # below the table: proportional to the width


def test_tensor_and_data_parallel_terms_by_hand():
    """tp 2 x dp 2 on one node of 4, ZeRO 1, 2 micro-batches of 2 streams."""
    cfg = rpe("parallel.tp=2", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=2")
    st = step_time(cfg, 4, TOY, 4, plan)
    ga, B, tp, dp = 2, 2, 2, 2
    # the narrowest GEMM: heads x d_head / tp = 32 (d 64, d_inner / tp 64, 32 rows x 2 streams) -> 75%
    assert st.width == 32 and st.efficiency == pytest.approx(0.75)
    assert st.terms["compute"] == pytest.approx(ga * 3 * rpe_forward_flops(B) / tp / (1e12 * 0.75))
    # 4 all-reduces per layer + 3 (embedding, cross-entropy) per micro-batch of the [32, 2, 64] fp32 activations,
    # 2 (tp-1)/tp = 1 of the bytes over the node's link
    act = 32 * 2 * 64 * 4
    assert st.terms["tp_comm"] == pytest.approx(ga * (4 * 4 + 3) * (1e-5 + act / 1e10))
    p = plan(cfg, 4, 1e9, 0)
    params = p.params / 4  # the rank's parameters (fp32)
    assert st.terms["dp_comm"] == pytest.approx(1e-5 + 2 * (dp - 1) / dp * params * 4 / 1e10)  # once a step
    assert st.terms["zero_gather"] == pytest.approx(1e-5 + (dp - 1) / dp * params * 4 / 1e10)
    # Adam over the rank's half (36 B/parameter), ZeRO's passes over it (28 B)
    assert st.terms["optimizer"] == pytest.approx(params / 2 * (36 + 28) / 1e11)
    # over all it holds, the reduction's copies into the bucket, average, flatten and copy back (4 x 8 B)
    assert st.terms["reduce_copies"] == pytest.approx(32 * params / 1e11)
    # the op trace's non-GEMM bytes of the rank's micro-batch (optrace.py; pinned in tests/plan/test_optrace.py) at 100
    # GB/s
    fwd, bwd = trace(cfg.model, B, tp, "fp32").stage(4, True, True)
    assert st.terms["elementwise"] == pytest.approx(
        ga * (fwd.bytes[~fwd.gemm].sum() + bwd.bytes[~bwd.gemm].sum()) / 1e11
    )
    assert st.terms["overhead"] == 0  # no host time measured
    # the second micro-batch's gradient added into .grad in fp32 (read both, write one: 12 B a parameter it holds)
    assert st.terms["grad_accum"] == pytest.approx((ga - 1) * 12 * params / 1e11)
    assert st.terms["pp_bubble"] == st.terms["pp_p2p"] == st.terms["first_touch"] == 0
    assert st.seconds == pytest.approx(sum(st.terms.values()))
    assert st.tokens_per_s == pytest.approx(8 * 32 / st.seconds)
    # HFU: the executed FLOPs of the global batch (8 streams); MFU: PaLM's 6 N + 18 x layers x H x klen a token,
    # N by hand: a layer's Q/K/V 3x64x64, r_net and o_net 64x64 each, FFN 64x128 + 128 + 128x64 + 64, two norms
    # 256: 37312, x4 layers; the tied table 256x64, its bias 256, u and v 2x64: 166016; RPE: klen = L = 32
    assert st.hfu == pytest.approx(3 * rpe_forward_flops(8) / (st.seconds * 4 * 1e12))
    assert st.mfu == pytest.approx(8 * 32 * (6 * 166016 + 18 * 4 * 64 * 32) / (st.seconds * 4 * 1e12))
    assert st.overlap_hides == 0  # one bucket: DeepSpeed cannot start reducing before the backward ends


def test_overlap_comm_would_hide_all_buckets_but_the_last():
    """lamemo-1.3b without model parallelism over 32 V100s (4 nodes), ZeRO 1: 1.37 B fp16 gradients are 3 buckets
    of 500 M; with overlap_comm the first two reduce during the last micro-batch's backward (2/3 of its compute)."""
    cfg = load(
        REPO / "configs" / "lamemo-1.3b.yaml", ["parallel.tp=1", "train.grad_accum=2", "eval.every=0", *DS_DEFAULTS]
    )
    st = step_time(cfg, 32, "v100-32g", 8, plan)
    n = 1_309_595_904 + (32000 - 256) * (2048 + 1)  # the byte-level model's count, + the 32k tied table's rows and bias
    bucket = 30e-6 + 2 * 31 / 32 * (n / 3) * 2 / 12.5e9
    assert st.terms["dp_comm"] == pytest.approx(3 * bucket)
    backward = 2 / 3 * st.terms["compute"] / 2
    assert st.overlap_hides == pytest.approx(3 * bucket - max(bucket, 3 * bucket - backward))
    assert 0 < st.overlap_hides <= 2 * bucket


def test_overlap_comm_hides_it_where_deepspeed_overlaps_and_bucket_size_sets_the_buckets():
    """The same layout with parallel.overlap_comm: dp_comm loses exactly what overlap_hides said it would hide, and
    nothing else moves. With parallel.reduce_bucket_size 1e8 the reduction is 14 buckets of n / 14 (ZeRO's gather
    keeps its own 5e8 buckets: 3); overlapped, only the last bucket - or what the backward cannot cover - remains.
    Under a pipeline (ZeRO 1, pp 2) DeepSpeed would not overlap: the candidate layouts `megamemo plan` ranks get
    no overlap there, whatever the config says."""
    path = REPO / "configs" / "lamemo-1.3b.yaml"
    base = ["parallel.tp=1", "train.grad_accum=2", "eval.every=0", *DS_DEFAULTS]
    off = step_time(load(path, base), 32, "v100-32g", 8, plan)
    on = step_time(load(path, [*base, "parallel.overlap_comm=true"]), 32, "v100-32g", 8, plan)
    assert on.overlapped and not off.overlapped and on.overlap_hides == off.overlap_hides > 0
    assert on.terms["dp_comm"] == pytest.approx(off.terms["dp_comm"] - off.overlap_hides)
    assert {k: v for k, v in on.terms.items() if k != "dp_comm"} == {
        k: v for k, v in off.terms.items() if k != "dp_comm"
    }
    assert on.seconds == pytest.approx(off.seconds - off.overlap_hides) and on.hfu > off.hfu and on.mfu > off.mfu
    assert "overlap_comm hides" in "\n".join(explain(on, "v100-32g"))
    assert "overlap_comm would hide" in "\n".join(explain(off, "v100-32g"))

    n = 1_309_595_904 + (32000 - 256) * (2048 + 1)  # as in the test above: 1.37 B fp16 gradients
    small = step_time(load(path, [*base, "parallel.reduce_bucket_size=100000000"]), 32, "v100-32g", 8, plan)
    bucket = 30e-6 + 2 * 31 / 32 * (n / 14) * 2 / 12.5e9
    assert small.terms["dp_comm"] == pytest.approx(14 * bucket)
    assert small.terms["zero_gather"] == off.terms["zero_gather"]
    both = step_time(
        load(path, [*base, "parallel.reduce_bucket_size=100000000", "parallel.overlap_comm=true"]),
        32,
        "v100-32g",
        8,
        plan,
    )
    backward = 2 / 3 * off.terms["compute"] / 2  # the last micro-batch's
    assert both.terms["dp_comm"] == pytest.approx(max(bucket, 14 * bucket - backward))

    piped = load(
        path,
        ["parallel.tp=1", "parallel.pp=2", "parallel.zero_stage=1", "train.grad_accum=2", "eval.every=0", *DS_DEFAULTS],
    )
    piped.parallel.overlap_comm = True  # as recommend's candidates: unvalidated
    st = step_time(piped, 32, "v100-32g", 8, plan)
    assert not st.overlapped and st.overlap_hides == 0


def test_dp_group_across_nodes_uses_the_slower_link_and_zero_2_reduces_every_micro_batch():
    one = rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=2")
    two = rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=2", "train.grad_accum=2")
    zero0 = rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=0", "train.grad_accum=2")
    params = plan(one, 4, 1e9, 0).params / 4
    st1, st2, st0 = (step_time(c, 4, TOY, 2, plan) for c in (one, two, zero0))  # 2 devices a node
    assert st1.terms["dp_comm"] == pytest.approx(1e-4 + 2 * 3 / 4 * params * 4 / 1e9)
    assert st2.terms["dp_comm"] == pytest.approx(2 * st1.terms["dp_comm"])
    assert st0.terms["zero_gather"] == 0 and st0.terms["dp_comm"] == pytest.approx(st1.terms["dp_comm"])
    assert st0.overlap_hides == 0  # ZeRO 0 reduces after the backward pass, always


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    """pp 2 over 2 devices, 4 micro-batches: the step's slots are m + p - 1 = 5 of the slowest stage's
    micro-batch (the last: 2 layers and the output layer), one of them idle; the sends: per slot the [64, 2, 64]
    activations and memory rows forward and their gradient back, each latency + bytes / 10 GB/s."""
    cfg = rpe("parallel.tp=1", "parallel.pp=2", "parallel.zero_stage=0", "train.grad_accum=4")
    st = step_time(cfg, 2, TOY, 2, plan)
    m, p = 4, 2
    B = 8 // m
    last_stage = 3 * (rpe_forward_flops(B, layers=2)) / (1e12 * TOY.eff(64))
    busy = st.terms["compute"] + st.terms["elementwise"]
    assert st.terms["compute"] == pytest.approx(m * last_stage)
    assert st.terms["pp_bubble"] / (busy + st.terms["pp_bubble"]) == pytest.approx((p - 1) / (m + p - 1))
    send = 1e-5 + (32 + 32) * B * 64 * 4 / 1e10
    tied = 1e-5 + 256 * 64 * 4 / 1e10  # the tied table's gradient all-reduced by the first and last stage
    assert st.terms["pp_p2p"] == pytest.approx(2 * (m + p - 1) * send + tied)


def test_the_tp_all_reduces_of_an_idle_slot_are_in_the_bubble():
    """tp 2 x pp 2 on one node of 4, 4 micro-batches of 2 streams: each of the p - 1 idle slots of the slowest stage
    (the last: 2 layers and the output side) costs its compute and its TP all-reduces - 4 a layer + 3 (embedding,
    cross-entropy) of the [32, 2, 64] fp32 activations, latency + 2 (tp-1)/tp of the bytes at 10 GB/s each."""
    cfg = rpe("parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=0", "train.grad_accum=4")
    st = step_time(cfg, 4, TOY, 4, plan)
    m, p = 4, 2
    per_slot = (4 * 2 + 3) * (1e-5 + 32 * 2 * 64 * 4 / 1e10)
    assert st.terms["tp_comm"] == pytest.approx(m * per_slot)
    work = (st.terms["compute"] + st.terms["elementwise"] + st.terms["overhead"]) / m
    assert st.terms["pp_bubble"] == pytest.approx((p - 1) * (work + per_slot))


def test_pipeline_stages_on_two_nodes_send_over_the_slower_link():
    """pp 2 over 2 nodes of 1 device: the stage boundary is between nodes, so each send (the [64, 2, 64] activations
    and memory rows forward, their gradient back, per slot) and the tied table's all-reduce take the inter-node
    link: 100 us + bytes / 1 GB/s."""
    cfg = rpe("parallel.tp=1", "parallel.pp=2", "parallel.zero_stage=0", "train.grad_accum=4")
    m, p, B = 4, 2, 2
    apart, together = step_time(cfg, 2, TOY, 1, plan), step_time(cfg, 2, TOY, 2, plan)
    send = 1e-4 + (32 + 32) * B * 64 * 4 / 1e9
    tied = 1e-4 + 256 * 64 * 4 / 1e9
    assert apart.terms["pp_p2p"] == pytest.approx(2 * (m + p - 1) * send + tied)
    assert together.terms["pp_p2p"] == pytest.approx(
        2 * (m + p - 1) * (1e-5 + (32 + 32) * B * 64 * 4 / 1e10) + 1e-5 + 256 * 64 * 4 / 1e10
    )


@pytest.mark.parametrize("pp", [1, 2])
def test_a_gpu_host_that_launches_slower_than_the_kernels_run_is_the_overhead(pp):
    """A GPU whose host takes 1 s to launch a kernel (its kernels take microseconds): the device waits on the host,
    so each micro-batch's wall is its kernels' launches, K x 1 s (K: the stage with the most kernels), and the
    overhead term is what that exceeds the kernels' own time by, for the 2 micro-batches of the step. A host that
    launches in 1 ps leaves none."""
    cfg = rpe("parallel.tp=1", f"parallel.pp={pp}", "parallel.zero_stage=0", "train.grad_accum=2")
    slow = Device("slow-host", TOY.peak, TOY.efficiency, TOY.mem_bw, TOY.link, TOY.latency, "test", launch=1.0)
    fast = Device("fast-host", TOY.peak, TOY.efficiency, TOY.mem_bw, TOY.link, TOY.latency, "test", launch=1e-12)
    st = step_time(cfg, pp, slow, pp, plan)
    stages = [trace(cfg.model, 4, 1, "fp32").stage(4 // pp, s == 0, s == pp - 1) for s in range(pp)]
    kernels = max(float(fwd.launches.sum() + bwd.launches.sum()) for fwd, bwd in stages)  # the slowest stage's
    assert kernels > 100
    assert st.terms["overhead"] == pytest.approx(
        2 * kernels * 1.0 - st.terms["compute"] - st.terms["elementwise"], rel=1e-6
    )
    assert step_time(cfg, pp, fast, pp, plan).terms["overhead"] == pytest.approx(0.0, abs=1e-9)


def test_cpu_ranks_sharing_cores_hide_the_bubble():
    """Two stages that compute half as fast while both do (measured contention 2 at 2 ranks, one core's worth):
    each rank's work takes twice as long, and the idle stage's core serves the other: the step is
    max((m+p-1) t, m t x 2) = 8 t for m = 4, no bubble."""
    shared = Device(
        "shared",
        TOY.peak,
        TOY.efficiency,
        TOY.mem_bw,
        TOY.link,
        TOY.latency,
        "test",
        contention=((16, 2.0), (64, 2.0)),
        ranks=2,
    )
    cfg = rpe("parallel.tp=1", "parallel.pp=2", "parallel.zero_stage=0", "train.grad_accum=4")
    alone, both = step_time(cfg, 2, TOY, 2, plan), step_time(cfg, 2, shared, 2, plan)
    assert both.terms["compute"] == pytest.approx(2 * alone.terms["compute"])
    assert both.terms["pp_bubble"] == 0 and alone.terms["pp_bubble"] > 0


def test_lamemo_1_3b_on_v100s_no_longer_ranks_tp8_first():
    """4 x 8 V100-32G: tp=8 leaves 256-wide GEMMs (16 heads x 128 / 8) at 42% of peak against the first layout's
    wider ones, and puts 4 all-reduces a layer on the critical path: its compute alone takes longer."""
    from megamemo.plan.recommend import recommend

    fits, _ = recommend(load(REPO / "configs" / "lamemo-1.3b.yaml"), 4, 8, 32, "gpu", "v100-32g", plan)
    first = fits[0]
    tp8 = [f for f in fits if f.desc.startswith("tp=8 ")]
    assert tp8 and not first.desc.startswith("tp=8 ")
    best8 = tp8[0].step
    assert best8.width == 256 and best8.efficiency < first.step.efficiency
    assert best8.terms["tp_comm"] > 0 and best8.terms["compute"] > first.step.terms["compute"]
    assert best8.tokens_per_s < first.step.tokens_per_s
    speeds = [f.step.tokens_per_s for f in fits]
    assert speeds == sorted(speeds, reverse=True)


def test_explain_prints_the_breakdown(capsys):
    path = str(REPO / "configs" / "lamemo-7b.yaml")
    assert (
        main(
            [
                "--config",
                path,
                "--nodes",
                "8",
                "--gpus-per-node",
                "8",
                "--gpu",
                "a100-80g",
                "--tp",
                "4",
                "--pp",
                "2",
                "--set",
                "train.grad_accum=8",
                *(a for s in DS_DEFAULTS for a in ("--set", s)),
                "--explain",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for term in (
        "compute",
        "tp_comm",
        "pp_bubble",
        "pp_p2p",
        "dp_comm",
        "GEMM width 1024",
        "dominant",
        "predicted step",
    ):
        assert term in out
    st = step_time(
        load(path, ["parallel.tp=4", "parallel.pp=2", "train.grad_accum=8", *DS_DEFAULTS]), 64, "a100-80g", 8, plan
    )
    assert f"{st.seconds * 1e3:.1f} ms" in out and "\n".join(explain(st, "a100-80g")) in out
    assert f"HFU {st.hfu:.1%}, MFU {st.mfu:.1%}" in out and 0 < st.mfu < st.hfu  # LaMemo: executes more


# ---- input the planner cannot use: one line, why, and the nearest that runs ------------------------------------
def test_unknown_device_kind(capsys):
    assert main(["--config", str(TINY), "--nodes", "1", "--gpus-per-node", "8", "--gpu", "a100-81g"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "unknown device kind 'a100-81g'" in line and "nearest: a100-80g" in line


def test_a_precision_the_device_lacks(capsys):
    assert (
        main(
            [
                "--config",
                str(REPO / "configs" / "lamemo-7b.yaml"),
                "--nodes",
                "8",
                "--gpus-per-node",
                "8",
                "--gpu",
                "v100-32g",
            ]
        )
        == 2
    )
    assert "v100-32g has no bf16 tensor cores" in one_line_error(capsys.readouterr().err)


def test_cluster_that_fits_nothing_names_the_smallest_that_does(capsys):
    """lamemo-7b (in fp16: V100s have no bf16) on one node of 8 V100-16G: nothing fits; nodes of 8 such devices
    run it from some node count on, and not on half as many."""
    from megamemo.plan.recommend import recommend

    path = REPO / "configs" / "lamemo-7b.yaml"
    assert (
        main(
            [
                "--config",
                str(path),
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--gpu",
                "v100-16g",
                "--set",
                "precision.dtype=fp16",
            ]
        )
        == 1
    )
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("megamemo plan: no layout fits 1 x 8 v100-16g: the smallest need is ")
    nodes = int(line.split("nearest that runs: ")[1].split()[0])
    cfg = load(path, ["precision.dtype=fp16"])
    assert recommend(cfg, nodes, 8, 16, "gpu", "v100-16g", plan)[0]
    assert not recommend(cfg, nodes // 2, 8, 16, "gpu", "v100-16g", plan)[0]


@pytest.mark.parametrize(
    "tp,pp,why",
    [
        ("3", "1", "model.n_head=16 is not divisible by tp=3"),
        ("16", "1", "tp=16 does not divide a node's 8 devices"),
        ("1", "64", "model.n_layer=24 is smaller than pp=64"),
        ("2", "3", "tp x pp = 6 does not divide the 32 devices"),
    ],
)
def test_a_layout_that_cannot_run_names_the_nearest_that_does(tp, pp, why, capsys):
    path = REPO / "configs" / "lamemo-1.3b.yaml"
    assert (
        main(
            ["--config", str(path), "--nodes", "4", "--gpus-per-node", "8", "--gpu", "v100-32g", "--tp", tp, "--pp", pp]
        )
        == 2
    )
    line = one_line_error(capsys.readouterr().err)
    assert why in line and "nearest layout that runs: tp=" in line
    assert capsys.readouterr().out == ""
    near = line.split("nearest layout that runs: ")[1]
    got = dict(kv.split("=") for kv in near.split()[:2])
    assert abs(math.log2(int(got["tp"]) / int(tp))) <= 2


def test_a_layout_that_does_not_fit_in_memory_names_the_nearest_that_does(capsys):
    """lamemo-1.3b on 8 V100-16G without model parallelism or ZeRO (25.1 GiB a rank: 16 bytes a parameter for
    1.37 B, 0.97 GiB more than the byte-level model's 24.1), and one line with the nearest layout that fits (the same
    tp and pp: ZeRO 1 leaves 14.1 GiB)."""
    path = REPO / "configs" / "lamemo-1.3b.yaml"
    assert (
        main(
            [
                "--config",
                str(path),
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--gpu",
                "v100-16g",
                "--tp",
                "1",
                "--pp",
                "1",
                "--set",
                "eval.every=0",
                "--set",
                "parallel.zero_stage=0",
                "--set",
                "train.grad_accum=8",
                *(a for s in DS_DEFAULTS for a in ("--set", s)),
            ]
        )
        == 1
    )
    line = one_line_error(capsys.readouterr().err)
    assert "needs 25.1 GiB" in line and "nearest layout that fits: tp=1 pp=1 dp=8 zero=1" in line


def test_cpu_row_shares_its_cores_between_the_ranks():
    """The measured CPU row: 4 ranks on 2 cores compute 2x slower than one alone (ranks / cores, no concurrent
    measurement), 2 ranks not slower; its efficiency table is the measured rates over the fastest."""
    from megamemo.plan.devices import CPU, CPU_CALIBRATION

    assert CPU.share(128, 4) == 2.0 and CPU.share(128, 2) == 1.0
    fastest = max(CPU_CALIBRATION["gemm"].values())
    assert CPU.peak["fp32"] == fastest * 1e9
    assert CPU.eff(128) == pytest.approx(CPU_CALIBRATION["gemm"][128] / fastest)


# ---- the CPU's measured layer GEMM rate and DeepSpeed ZeRO step (issue 25: what the width table missed) --------
def test_a_measured_layer_rate_replaces_the_width_table_for_that_layer_shape_only():
    """tp 2 x dp 2 of the tiny RPE model (d 64, 2 x 32 heads, d_inner 128), 2 streams of 32 rows a micro-batch: with
    the rate of that layer's projections measured at tp 2 and 64 rows (0.4 TFLOP/s), the compute is the FLOPs over
    it, not over the width table's 75% of 1 TFLOP/s; a device that measured another layer shape, or another
    (tp, rows), keeps the table."""
    cfg = rpe("parallel.tp=2", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=2")
    base = dict(
        peak=TOY.peak, efficiency=TOY.efficiency, mem_bw=TOY.mem_bw, link=TOY.link, latency=TOY.latency, source="test"
    )
    measured = Device("m", **base, layer_gemm={(2, 64): 0.4e12}, layer_shape=(64, 64, 128))
    st = step_time(cfg, 4, measured, 4, plan)
    assert st.terms["compute"] == pytest.approx(2 * 3 * rpe_forward_flops(2) / 2 / 0.4e12)
    assert st.efficiency == pytest.approx(0.4) and st.width == 32
    for other in (
        Device("o", **base, layer_gemm={(2, 64): 0.4e12}, layer_shape=(64, 64, 256)),
        Device("o", **base, layer_gemm={(2, 128): 0.4e12}, layer_shape=(64, 64, 128)),
    ):
        assert step_time(cfg, 4, other, 4, plan).terms["compute"] == pytest.approx(
            2 * 3 * rpe_forward_flops(2) / 2 / (1e12 * 0.75)
        )


def test_a_measured_zero_step_replaces_the_byte_model_of_the_optimizer():
    """ZeRO 1 over dp 2 with DeepSpeed's step measured as 5 ns per parameter held and 11 ns per parameter owned
    (the rank holds its tp half of the model and owns half of that), nothing measured at dp 2: the reduction's
    copies are 5 P, the optimizer 11 P / 2, and nothing is counted again as first touch; ZeRO 0 keeps the byte
    model (no DeepSpeed ZeRO optimizer)."""
    cfg = rpe("parallel.tp=2", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=2")
    dev = Device(
        "z",
        TOY.peak,
        TOY.efficiency,
        TOY.mem_bw,
        TOY.link,
        TOY.latency,
        "test",
        first_touch_bw=1e9,
        zero_step=(5e-9, 11e-9),
    )
    params = plan(cfg, 4, 1e9, 0).params / 4
    st = step_time(cfg, 4, dev, 4, plan)
    assert st.terms["reduce_copies"] == pytest.approx(5e-9 * params)
    assert st.terms["optimizer"] == pytest.approx(11e-9 * params / 2)
    assert st.terms["first_touch"] == 0
    zero0 = step_time(
        load(
            TINY,
            [
                "model.variant=rpe",
                "model.n_layer=4",
                "eval.every=0",
                "parallel.tp=2",
                "parallel.pp=1",
                "parallel.zero_stage=0",
                "train.grad_accum=2",
            ],
        ),
        4,
        dev,
        4,
        plan,
    )
    assert zero0.terms["optimizer"] == pytest.approx(params * 36 / 1e11)  # Adam
    assert zero0.terms["reduce_copies"] == pytest.approx(32 * params / 1e11)  # the DP copies
    assert zero0.terms["first_touch"] == pytest.approx((params * 4 + params * 4) / 1e9)  # gradient + flat copy


def test_the_reduction_measured_at_dp_group_sizes_replaces_the_dp1_figure():
    """DeepSpeed's gradient reduction beyond its all-reduce measured per parameter held at dp 1 (zero_step: 5 ns),
    in 2 processes (8 ns) and in 4 (12 ns), on a device of 2 cores whose 4 ranks each run 2x slower while all
    compute (contention 2 = ranks / cores, as the CPU row without --concurrent). By hand, P the rank's parameters:
    - DP4 (tp 1, dp 4, ZeRO 1): the dp-4 figure, measured with the 4 ranks sharing the cores as in the run: 12 P;
    - TP2 x DP2: the dp-2 figure, measured in 2 processes on 2 cores (each a core of its own), run while 4 ranks
      share them: x2 -> 2 x 8 P;
    - TP4 (dp 1): the dp-1 figure, measured alone, x2 for the sharing: 2 x 5 P;
    - ZeRO 2 over dp 4 with 2 micro-batches reduces after each: 2 x 12 P;
    - dp 8 (not measured) takes the nearest measured group, 4."""
    dev = Device(
        "c",
        TOY.peak,
        TOY.efficiency,
        TOY.mem_bw,
        TOY.link,
        TOY.latency,
        "test",
        first_touch_bw=1e9,
        zero_step=(5e-9, 11e-9),
        zero_reduce={2: ((1e3, 8e-9),), 4: ((1e3, 12e-9),)},
        contention=((16, 2.0), (64, 2.0)),
        ranks=4,
    )

    def held(cfg, world):
        return plan(cfg, world, 1e9, 0).params / 4

    dp4 = rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=1")
    assert step_time(dp4, 4, dev, 4, plan).terms["reduce_copies"] == pytest.approx(12e-9 * held(dp4, 4))
    tp2dp2 = rpe("parallel.tp=2", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=1")
    assert step_time(tp2dp2, 4, dev, 4, plan).terms["reduce_copies"] == pytest.approx(2 * 8e-9 * held(tp2dp2, 4))
    tp4 = rpe(
        "parallel.tp=4",
        "parallel.pp=1",
        "parallel.zero_stage=1",
        "train.grad_accum=1",
        "model.n_head=4",
        "model.d_head=16",
    )
    assert step_time(tp4, 4, dev, 4, plan).terms["reduce_copies"] == pytest.approx(2 * 5e-9 * held(tp4, 4))
    zero2 = rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=2", "train.grad_accum=2")
    assert step_time(zero2, 4, dev, 4, plan).terms["reduce_copies"] == pytest.approx(2 * 12e-9 * held(zero2, 4))
    dp8 = rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=1")
    assert step_time(dp8, 8, dev, 8, plan).terms["reduce_copies"] == pytest.approx(
        12e-9 * held(dp8, 8) * 2
    )  # 8 ranks on the node share 4 ways, the measurement 2 ways


def test_cpu_row_uses_its_measured_layer_rates_for_the_rehearsal_layer():
    """The shipped CPU calibration measured the rehearsal's layer (d 2048, 16 x 128 heads, d_inner 8192) at tp 1, 2,
    4 and 64-256 rows: TP2 x PP2's 2 streams of 64 rows use the 2x128 figure; lamemo-1.3b's own layer shape too
    (the same layer), a smaller model does not."""
    from megamemo.plan.devices import CPU, CPU_CALIBRATION

    reh = load(REPO / "configs" / "rehearsal-1.3b-width.yaml")
    assert CPU.layer_rate(reh.model, 2, 128) == CPU_CALIBRATION["layer_gemm"]["2x128"] * 1e9
    st = step_time(reh, 4, CPU, 4, plan)
    assert st.efficiency == pytest.approx(
        CPU_CALIBRATION["layer_gemm"]["2x128"] / max(CPU_CALIBRATION["gemm"].values())
    )
    big = load(REPO / "configs" / "lamemo-1.3b.yaml").model
    assert CPU.layer_rate(big, 1, 64) == CPU_CALIBRATION["layer_gemm"]["1x64"] * 1e9
    assert CPU.layer_rate(load(TINY).model, 1, 64) is None
    assert CPU.zero_step == tuple(x * 1e-9 for x in CPU_CALIBRATION["zero_ns"])
    assert set(CPU.zero_reduce) == {2, 4}  # TP2 x DP2 and DP4 on the rehearsal machine
    for dp, by_size in CPU_CALIBRATION["zero_reduce_ns"].items():
        for n, ns in by_size.items():
            assert CPU.reduce_rate(dp, n) == pytest.approx(ns * 1e-9)


def test_the_reductions_cost_is_interpolated_by_the_parameters_a_rank_holds():
    """zero_reduce measured at 1 M and 4 M parameters held (10 and 30 ns per parameter) in a group of 4: at 2 M,
    halfway in log(size), 20 ns; below the smallest and above the largest measured size their own figures; dp 8
    (not measured) the nearest group, 4. A calibration from before the size axis (one figure per group) was
    measured at 33.6 M parameters."""
    from megamemo.plan.devices import CPU_CALIBRATION, ZERO_REDUCE_OLD_PARAMS, cpu_device

    dev = Device(
        "c",
        TOY.peak,
        TOY.efficiency,
        TOY.mem_bw,
        TOY.link,
        TOY.latency,
        "test",
        zero_reduce={4: ((1e6, 10e-9), (4e6, 30e-9))},
    )
    assert dev.reduce_rate(4, 2e6) == pytest.approx(20e-9)
    assert dev.reduce_rate(4, 1e5) == pytest.approx(10e-9) and dev.reduce_rate(4, 1e8) == pytest.approx(30e-9)
    assert dev.reduce_rate(8, 2e6) == pytest.approx(20e-9)
    old = cpu_device(dict(CPU_CALIBRATION, zero_reduce_ns={"2": 6.73, "4": 9.85}))
    assert [(dp, n) for dp, ((n, _),) in old.zero_reduce.items()] == [
        (2, ZERO_REDUCE_OLD_PARAMS),
        (4, ZERO_REDUCE_OLD_PARAMS),
    ]
    assert old.reduce_rate(2, 1e9) == pytest.approx(6.73e-9) and old.reduce_rate(4, 1) == pytest.approx(9.85e-9)
    assert ZERO_REDUCE_OLD_PARAMS == 33_554_432


@pytest.mark.parametrize(
    "args,why",
    [
        (["--nodes", "0", "--gpus-per-node", "8"], "--nodes must be at least 1 (got 0)"),
        (["--nodes", "1", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1 (got 0)"),
        (["--nodes", "4", "--gpus-per-node", "8", "--tp", "0"], "--tp must be at least 1 (got 0)"),
        (["--nodes", "4", "--gpus-per-node", "8", "--pp", "-2"], "--pp must be at least 1 (got -2)"),
        (["--nodes", "1", "--gpus-per-node", "4", "--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_an_impossible_cluster_shape_or_device_is_one_line(args, why, capsys):
    """No traceback (--nodes 0 divided by zero), no ignored flag (--tp 0 was read as 'not given'), no usage block."""
    try:
        code = main(["--config", str(REPO / "configs" / "lamemo-1.3b.yaml"), *args])
    except SystemExit as e:  # argparse's own errors exit
        code = e.code
    assert code == 2
    assert why in one_line_error(capsys.readouterr().err)
    assert capsys.readouterr().out == ""


def test_cpu_collectives_time_share_the_cores_like_compute():
    """4 ranks on 2 cores (contention 2 at 4 ranks: ranks / cores). A 2-process all-reduce was measured with its 2
    processes on the 2 cores; under tp 2 x dp 2 both DP groups (and both TP groups) run theirs at once on the same
    2 cores: twice the measured time. Under dp 4 the 4-process measurement already shared the cores 4 ways: 1x."""
    cpu = Device(
        "cpu2",
        TOY.peak,
        TOY.efficiency,
        TOY.mem_bw,
        TOY.link,
        TOY.latency,
        "test",
        contention=((16, 2.0), (64, 2.0)),
        ranks=4,
        allreduce={2: (1e-3, 1e9), 4: (2e-3, 0.5e9)},
        allgather={2: (1e-3, 0.4e9), 4: (2e-3, 0.3e9)},
    )
    cfg = rpe("parallel.tp=2", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=2")
    st = step_time(cfg, 4, cpu, 4, plan)
    grad = plan(cfg, 4, 1e9, 0).params  # the rank's fp32 gradient bytes
    assert st.terms["dp_comm"] == pytest.approx(2 * (1e-3 + 2 * 1 / 2 * grad / 1e9))
    assert st.terms["zero_gather"] == pytest.approx(2 * (1e-3 + 1 / 2 * grad / 0.4e9))
    act = 32 * 2 * 64 * 4  # [32 rows, 2 streams, d 64] fp32
    assert st.terms["tp_comm"] == pytest.approx(2 * (4 * 4 + 3) * 2 * (1e-3 + act / 1e9))
    dp4 = step_time(
        rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=2"), 4, cpu, 4, plan
    )
    grad4 = plan(rpe("parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=1", "train.grad_accum=2"), 4, 1e9, 0).params
    assert dp4.terms["dp_comm"] == pytest.approx(2e-3 + 2 * 3 / 4 * grad4 / 0.5e9)
