"""Cost model: parameter counts, roofline step times, collectives, pipelines, memory."""

from __future__ import annotations

import dataclasses
import math

import pytest

from meshserve.launch.cli_config import load_config
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import (
    CostModel,
    Layout,
    StageTime,
    StepWork,
    decode_bound_tokens_per_s,
    p2p_s,
    ring_allgather_s,
    ring_allreduce_s,
)
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.search import shape_for


def shape(model: str, dtype: str = "bfloat16") -> ModelShape:
    arch = ModelArch.from_hf_dict(load_config([f"model={model}"]).model.arch)
    return ModelShape.from_arch(arch, dtype)


def cluster(name: str) -> ClusterConfig:
    return load_config([f"cluster={name}"]).cluster


H100 = cluster("dgx-h100")


def test_shape_counts_match_the_architecture() -> None:
    s = shape("llama-3-8b")
    assert s.num_params == 8_030_261_248 == ModelArch.from_hf_dict(
        load_config(["model=llama-3-8b"]).model.arch).num_params
    assert s.layer_params() == 218_112_000
    assert s.layer_matmul_flops() == 436_207_616
    assert s.kv_bytes_per_token() == 2 * 8 * 128 * 2 == 4096
    assert s.kv_bytes_per_token(tp=16) == 2 * 1 * 128 * 2  # 8 KV heads replicated to one per rank
    assert s.tp_error(3) == "tp=3 does not divide num_attention_heads=32"
    assert s.tp_error(16) is None


def test_70b_bf16_is_141_gb_and_does_not_fit_one_80_gb_gpu() -> None:
    s = shape("llama-3-70b")
    assert s.num_params == 70_553_706_496
    assert s.weight_bytes == 141_107_412_992
    assert s.weight_bytes > H100.device_memory_gb * 1e9
    assert s.kv_bytes_per_token() * s.num_layers == 327_680


def test_decode_bound_llama_3_8b_on_h100_is_about_209_tokens_per_s() -> None:
    # 3.35 TB/s / 16.06 GB of weights.
    assert decode_bound_tokens_per_s(shape("llama-3-8b"), H100) == pytest.approx(208.586, abs=1e-3)


def test_batch_1_decode_reads_the_weights_but_only_one_embedding_row() -> None:
    cm = CostModel(shape("llama-3-8b"), H100, Layout(tp=1, stage_layers=(32,)))
    # 2 x (all params - the untied input embedding) + one token's K/V in 32 layers + one row.
    nbytes = 2 * (8_030_261_248 - 525_336_576) + 32 * 4096 + 4096 * 2
    assert cm.tpot_s(1, 0) == pytest.approx(nbytes / 3.35e12, rel=1e-12)
    assert 1 / cm.tpot_s(1, 0) == pytest.approx(223.18, abs=0.01)


def test_prefill_is_compute_bound() -> None:
    cm = CostModel(shape("llama-3-8b"), H100, Layout(tp=1, stage_layers=(32,)))
    cost = cm.step(StepWork.prefill(1024))
    # The layers are compute-bound; the LM head (one logits row) is bound by reading itself.
    flops = 32 * (1024 * 436_207_616 + 4 * 32 * 128 * 1024 * 1025 / 2)
    assert cost.compute_s == pytest.approx(flops / 989e12, rel=1e-12)
    assert cost.memory_s == pytest.approx((2 * (525_336_576 + 4096) + 1024 * 8192) / 3.35e12, rel=1e-9)
    assert cost.total_s == pytest.approx(cost.compute_s + cost.memory_s)
    assert cost.comm_s == cost.bubble_s == 0.0
    assert cm.ttft_s(1024) == cost.total_s


def test_ring_collectives() -> None:
    assert ring_allreduce_s(8, 1e6, 450e9, 1.5e-6) == pytest.approx(14 * 1.5e-6 + 1.75e6 / 450e9)
    assert ring_allreduce_s(1, 1e9, 1.0, 1.0) == 0.0
    assert ring_allgather_s(4, 4e6, 50e9, 5e-6) == pytest.approx(3 * 5e-6 + 3e6 / 50e9)
    assert p2p_s(1e6, 50e9, 5e-6) == pytest.approx(5e-6 + 2e-5)


def test_tp_step_pays_two_allreduces_per_layer_plus_embedding_and_logits() -> None:
    s = shape("llama-3-8b")
    cm = CostModel(s, H100, Layout(tp=8, stage_layers=(32,)))
    act = 4 * 4096 * 2  # 4 tokens of hidden states
    expect = (2 * 32 + 1) * ring_allreduce_s(8, act, 450e9, 1.5e-6) + ring_allgather_s(
        8, 4 * 128256 * 4, 450e9, 1.5e-6)
    assert cm.step(StepWork.decode(4, 100)).comm_s == pytest.approx(expect, rel=1e-12)
    across = CostModel(s, H100, Layout(tp=8, stage_layers=(32,), tp_link="inter"))
    assert across.step(StepWork.decode(4, 100)).comm_s > 3 * cm.step(StepWork.decode(4, 100)).comm_s


def two_stages(link: str, micro_batches: int, **changes: object
               ) -> tuple[CostModel, CostModel]:
    """Llama-3-8B on H100s as 16 + 16 layers: the layout as given, and with `changes`."""
    lay = Layout(tp=1, stage_layers=(16, 16), stage_links=(link,),
                 num_micro_batches=micro_batches)
    s = shape("llama-3-8b")
    return CostModel(s, H100, lay), CostModel(s, H100, dataclasses.replace(lay, **changes))


def test_pipeline_bubbles_shrink_with_micro_batches() -> None:
    one, two = two_stages("inter", 1, num_micro_batches=2)
    work = StepWork.decode(64, 1000)
    c1, c2 = one.step(work), two.step(work)
    stages = [one.stage_time(i, work).total_s for i in range(2)]
    send = p2p_s(64 * 4096 * 2, 50e9, 5e-6)
    assert c1.total_s == pytest.approx(sum(stages) + send)  # one micro-batch: a relay
    assert c1.bubble_s == pytest.approx(c1.total_s - sum(stages) / 2)
    assert c1.bubble_s / c1.total_s == pytest.approx(0.5, abs=0.05)
    assert c2.bubble_s / c2.total_s < 0.1
    parts = c2.compute_s + c2.memory_s + c2.comm_s + c2.overhead_s + c2.bubble_s
    assert parts == pytest.approx(c2.total_s)
    assert one.step(StepWork.decode(1, 1000)).total_s == two.step(StepWork.decode(1, 1000)).total_s
    # A burst into an empty pipeline: one micro-batch's trip, then one busiest-stage time
    # for each further micro-batch (the fill and drain that steady state hides).
    half = [two.stage_time(i, work.scaled(0.5)).total_s for i in range(2)]
    trip = sum(half) + p2p_s(32 * 4096 * 2, 50e9, 5e-6)
    assert two.step(work, isolated=True).total_s == pytest.approx(trip + max(half))
    assert two.step(work, isolated=True).total_s > c2.total_s


def test_a_split_lm_head_moves_half_its_time_and_weights_to_stage_0() -> None:
    whole, split = two_stages("intra", 2, head_first_fraction=0.5)
    s = whole.shape
    work = StepWork.decode(32, 1000)
    head = whole.head_time(work).total_s
    assert split.stage_time(0, work).total_s == pytest.approx(
        whole.stage_time(0, work).total_s + head / 2)
    assert split.stage_time(1, work).total_s == pytest.approx(
        whole.stage_time(1, work).total_s - head / 2)
    moved = s.head_params(1) // 2 * s.dtype_bytes
    assert split.stage_weight_bytes(0) == pytest.approx(whole.stage_weight_bytes(0) + moved,
                                                        rel=1e-6)
    with pytest.raises(ValueError, match="layout.head_first_fraction"):
        Layout(stage_layers=(32,), head_first_fraction=0.5)


def test_memory_weights_activations_and_kv_capacity() -> None:
    cm = CostModel(shape("llama-3-8b"), H100, Layout(tp=1, stage_layers=(32,)))
    assert cm.stage_weight_bytes(0) == 16_060_522_496
    act = cm.activation_bytes(2048, 32)
    assert act == 2048 * (4 * 4096 + 2 * 14336) * 2 + 32 * 128256 * 4 == 200_966_144
    assert cm.kv_capacity_tokens(72e9, act) == 425_251
    split = CostModel(shape("llama-3-8b"), H100,
                      Layout(tp=2, stage_layers=(17, 15), stage_links=("intra",)))
    # Stage 0 holds the embedding, the last stage the LM head; TP halves both.
    assert split.stage_weight_bytes(0) == 2 * (17 * 109_060_096 + 262_668_288)
    assert split.stage_weight_bytes(1) == 2 * (15 * 109_060_096 + 262_668_288 + 4096)
    assert split.kv_capacity_tokens(100e9, 0) == int((100e9 - split.stage_weight_bytes(0))
                                                      // (17 * 2048))


def test_cpu_ranks_share_the_sockets_bandwidth() -> None:
    cpu = cluster("local-cpu")
    assert cpu.memory_bandwidth(1) == 27e9
    assert cpu.memory_bandwidth(2) == 15.5e9
    assert H100.memory_bandwidth(8) == 3350e9
    assert cpu.peak_flops("float32") == pytest.approx(84e9)
    with pytest.raises(ValueError, match=r"dtype='int8' is invalid"):
        cpu.peak_flops("int8")


def test_cluster_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"cluster.nvlink_domain_size=3 is invalid: allowed is "
                                         r"a divisor of devices_per_node=8"):
        ClusterConfig(devices_per_node=8, nvlink_domain_size=3)
    with pytest.raises(ValueError, match=r"cluster.source='guess' is invalid"):
        ClusterConfig(source="guess")


def test_fixed_overheads_per_step_and_per_layer() -> None:
    s = shape("llama-3-8b")
    base = CostModel(s, H100, Layout(tp=1, stage_layers=(32,)))
    slow = CostModel(s, dataclasses.replace(H100, step_overhead_us=500.0, layer_overhead_us=10.0),
                     Layout(tp=1, stage_layers=(32,)))
    work = StepWork.decode(4, 100)
    assert slow.step(work).total_s - base.step(work).total_s == pytest.approx(500e-6 + 320e-6)
    assert slow.step(work).overhead_s == pytest.approx(820e-6)
    # With two stages and two micro-batches, each micro-batch pays the driver's step overhead.
    two = Layout(tp=1, stage_layers=(16, 16), stage_links=("intra",), num_micro_batches=2)
    piped = CostModel(s, dataclasses.replace(H100, step_overhead_us=500.0), two)
    assert piped.stage_time(0, work).overhead_s == pytest.approx(500e-6)
    assert piped.stage_time(1, work).overhead_s == 0.0


def test_small_matmuls_run_below_peak_when_the_cluster_says_so() -> None:
    cpu = dataclasses.replace(cluster("local-cpu"), matmul_half_rows=16.0)
    assert cpu.matmul_flops("float32", 16) == pytest.approx(cpu.peak_flops("float32") / 2)
    assert cpu.matmul_flops("float32", 0) == cpu.peak_flops("float32")
    s = shape("llama-3-8b", "float32")
    layout = Layout(tp=1, stage_layers=(32,))
    at_peak = CostModel(s, cluster("local-cpu"), layout).layer_time(StepWork.decode(8, 256))
    slow = CostModel(s, cpu, layout).layer_time(StepWork.decode(8, 256))
    # Decode's 8-row matmuls at 8 / (8 + 16) of peak: three times the compute time.
    matmul_s = 8 * s.layer_matmul_flops(1) / cpu.peak_flops("float32")
    assert slow.compute_s - at_peak.compute_s == pytest.approx(2 * matmul_s, rel=1e-9)


def test_a_measured_matmul_efficiency_table_is_interpolated_in_log_rows() -> None:
    cpu = dataclasses.replace(cluster("local-cpu"), matmul_efficiency=[0.1, 0.2, 0.4],
                              matmul_half_rows=16.0)  # the table wins over the curve
    peak = cpu.peak_flops("float32")
    assert cpu.matmul_flops("float32", 1) == pytest.approx(0.1 * peak)
    assert cpu.matmul_flops("float32", 2) == pytest.approx(0.2 * peak)
    assert cpu.matmul_flops("float32", 3) == pytest.approx((0.2 + 0.2 * math.log2(1.5)) * peak)
    assert cpu.matmul_flops("float32", 4) == cpu.matmul_flops("float32", 4096) == \
        pytest.approx(0.4 * peak)
    with pytest.raises(ValueError, match=r"cluster.matmul_efficiency=\[0.5, 1.5\]"):
        dataclasses.replace(cpu, matmul_efficiency=[0.5, 1.5])


def test_a_slow_paged_kv_read_prices_only_the_kv_bytes_slower() -> None:
    base = cluster("local-cpu")
    slow = dataclasses.replace(base, kv_read_fraction=0.25)
    s = shape("llama-3-8b", "float32")
    layout = Layout(tp=1, stage_layers=(32,))
    work = StepWork.decode(1, 4096)  # one row: bound by memory either way
    fast_t = CostModel(s, base, layout).layer_time(work)
    slow_t = CostModel(s, slow, layout).layer_time(work)
    kv_s = (4096 + 1) * s.kv_bytes_per_token(1) / base.memory_bandwidth()
    assert slow_t.memory_s - fast_t.memory_s == pytest.approx(3 * kv_s, rel=1e-9)
    with pytest.raises(ValueError, match=r"cluster.kv_read_fraction"):
        dataclasses.replace(base, kv_read_fraction=0.0)


def test_kv_rows_cost_a_fixed_time_each_beside_their_bytes() -> None:
    base = cluster("local-cpu")
    per_row = dataclasses.replace(base, kv_row_overhead_ns=60.0)
    s = shape("llama-3-8b", "float32")
    layout = Layout(tp=1, stage_layers=(32,))
    for work in (StepWork.decode(8, 1000), StepWork.prefill(100, 500)):
        plain = CostModel(s, base, layout).layer_time(work)
        rows = CostModel(s, per_row, layout).layer_time(work)
        assert rows.overhead_s - plain.overhead_s == pytest.approx(work.num_kv_read * 60e-9)
        assert (rows.compute_s, rows.memory_s) == (plain.compute_s, plain.memory_s)
    with pytest.raises(ValueError, match=r"cluster.kv_row_overhead_ns=-1"):
        dataclasses.replace(base, kv_row_overhead_ns=-1.0)


def test_each_sequence_costs_a_fixed_time_per_step_outside_the_layers() -> None:
    base = cluster("local-cpu")
    per_seq = dataclasses.replace(base, step_seq_overhead_us=35.0)
    s = shape("llama-3-8b", "float32")
    for stages in ((32,), (16, 16)):  # paid once per step, on stage 0
        layout = Layout(tp=1, stage_layers=stages, stage_links=("intra",) * (len(stages) - 1))
        plain, more = (CostModel(s, c, layout) for c in (base, per_seq))
        for batch in (1, 16):
            work = StepWork.decode(batch, 100)
            assert more.stage_time(0, work).overhead_s - plain.stage_time(0, work).overhead_s \
                == pytest.approx(batch * 35e-6)
            assert more.stage_time(len(stages) - 1, work).total_s - \
                plain.stage_time(len(stages) - 1, work).total_s == pytest.approx(
                    batch * 35e-6 if len(stages) == 1 else 0.0)


def test_attention_efficiency_slows_only_attention_compute() -> None:
    base = cluster("local-cpu")
    half = dataclasses.replace(base, attention_efficiency=0.5)
    s = shape("llama-3-8b", "float32")
    cost, slow = (CostModel(s, c, Layout(tp=1, stage_layers=(32,))) for c in (base, half))
    work = StepWork.prefill(512, 512)  # compute-bound
    attention_s = s.attention_flops(work.num_attended) / base.peak_flops("float32")
    assert slow.layer_time(work).compute_s - cost.layer_time(work).compute_s == \
        pytest.approx(attention_s)
    with pytest.raises(ValueError, match=r"cluster.attention_efficiency=1.5"):
        dataclasses.replace(base, attention_efficiency=1.5)


def test_work_and_stage_time_arithmetic_covers_every_field() -> None:
    """The sums and scalings are written out field by field (simulations call them per
    step): a field added later must be added there too."""
    w = StepWork(num_new_tokens=1, num_seqs=2, num_kv_read=3, num_attended=4)
    names = [f.name for f in dataclasses.fields(StepWork)]
    assert [getattr(w + w, n) for n in names] == [2 * getattr(w, n) for n in names]
    assert [getattr(w.scaled(3), n) for n in names] == [3 * getattr(w, n) for n in names]
    assert all(getattr(w, n) for n in names)
    t = StageTime(compute_s=1, memory_s=2, comm_s=3, overhead_s=4)
    names = [f.name for f in dataclasses.fields(StageTime)]
    assert [getattr(t + t, n) for n in names] == [2 * getattr(t, n) for n in names]
    assert [getattr(t.times(3), n) for n in names] == [3 * getattr(t, n) for n in names]
    assert all(getattr(t, n) for n in names)
    with pytest.raises(ValueError, match="work.num_kv_read"):
        StepWork(num_kv_read=-1)
    with pytest.raises(ValueError, match="work.num_attended"):
        StepWork(num_attended=math.nan)


def test_a_bf16_cache_under_an_fp32_model_halves_only_the_kv_bytes() -> None:
    """engine.kv_cache_dtype reaches the cost model through search.shape_for: the KV read
    of a decode step and the cache's bytes per token halve, the weights' do not."""
    full = shape_from(["cluster=local-cpu", "model.dtype=float32"])
    half = shape_from(["cluster=local-cpu", "model.dtype=float32",
                       "engine.kv_cache_dtype=bfloat16"])
    assert full.kv_bytes_per_token() == 2 * half.kv_bytes_per_token() == 2 * 8 * 128 * 4
    assert half.weight_bytes == full.weight_bytes
    layout = Layout(tp=1, stage_layers=(32,))
    work = StepWork.decode(1, 4096)
    base = cluster("local-cpu")
    t_full = CostModel(full, base, layout).layer_time(work).memory_s
    t_half = CostModel(half, base, layout).layer_time(work).memory_s
    kv_s = (4096 + 1) * half.kv_bytes_per_token(1) / (base.memory_bandwidth()
                                                      * base.kv_read_fraction)
    assert t_full - t_half == pytest.approx(kv_s, rel=1e-9)
    with pytest.raises(ValueError, match=r"engine.kv_cache_dtype"):
        ModelShape.from_arch(ModelArch.from_hf_dict(load_config(["model=llama-3-8b"]).model.arch),
                             "float32", "fp8")


def shape_from(overrides: list[str]) -> ModelShape:
    cfg = load_config(["model=llama-3-8b", *overrides])
    return shape_for(cfg, ModelArch.from_hf_dict(cfg.model.arch), "cpu")


def test_bf16_weights_under_an_fp32_model_halve_only_the_weight_bytes() -> None:
    """model.cpu_weight_dtype on a CPU: a decode step reads half the weight bytes; the KV
    and the arithmetic's rate stay fp32's. On a GPU the knob has no effect."""
    full = shape_from(["cluster=local-cpu", "model.dtype=float32"])
    half = shape_from(["cluster=local-cpu", "model.dtype=float32",
                       "model.cpu_weight_dtype=bfloat16"])
    assert 2 * half.weight_bytes == full.weight_bytes
    assert half.kv_bytes_per_token() == full.kv_bytes_per_token()
    layout = Layout(tp=1, stage_layers=(32,))
    base = cluster("local-cpu")
    t_full = CostModel(full, base, layout).layer_time(StepWork.decode(1, 16)).memory_s
    t_half = CostModel(half, base, layout).layer_time(StepWork.decode(1, 16)).memory_s
    weights_s = half.layer_params() * 2 / base.memory_bandwidth()
    assert t_full - t_half == pytest.approx(weights_s, rel=1e-9)
    cfg = load_config(["model=llama-3-8b", "model.cpu_weight_dtype=bfloat16"])
    gpu = shape_for(cfg, ModelArch.from_hf_dict(cfg.model.arch), "cuda")
    assert gpu.weight_dtype is None
