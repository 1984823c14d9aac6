"""ParallelDims validation, rank placement, and the groups built on one gloo rank."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from meshserve.parallel.comm.mesh import ParallelDims, ProcessGroups, mesh_order, place_replicas
from meshserve.parallel.parallel_config import ParallelConfig

LLAMA = dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=5,
             intermediate_size=112)


def test_degrees_must_multiply_to_the_world_size() -> None:
    dims = ParallelDims.from_config(ParallelConfig(tp=2, pp=2), 4)
    assert dims.mesh_shape == (1, 2, 2)
    with pytest.raises(ValueError, match=r"parallel.tp \* parallel.pp \* parallel.dp = "
                                         r"2 \* 2 \* 1 = 4 ranks, but the world has 3"):
        ParallelDims.from_config(ParallelConfig(tp=2, pp=2), 3)
    with pytest.raises(ValueError, match="parallel.tp=0 is invalid"):
        ParallelDims(tp=0)


@pytest.mark.parametrize(("tp", "pp", "shape", "message"), [
    (3, 1, {}, r"parallel.tp=3 does not divide num_attention_heads=8: allowed tp: 1, 2, 4, 8$"),
    (8, 1, {"intermediate_size": 100},
     r"parallel.tp=8 does not divide intermediate_size=100: allowed tp: 1, 2, 4, 5, 10, 20, "),
    (1, 6, {}, r"parallel.pp=6 exceeds num_hidden_layers=5: every stage needs at least one layer"),
])
def test_model_shapes_that_cannot_be_split(tp: int, pp: int, shape: dict[str, int],
                                           message: str) -> None:
    dims = ParallelDims(tp=tp, pp=pp, world_size=tp * pp)
    with pytest.raises(ValueError, match=message):
        dims.check_model(**{**LLAMA, **shape})


def test_kv_heads_divide_or_replicate() -> None:
    ParallelDims(tp=4, world_size=4).check_model(**LLAMA)  # 2 KV heads, each on 2 ranks
    ParallelDims(tp=8, world_size=8).check_model(**{**LLAMA, "intermediate_size": 128})
    with pytest.raises(ValueError, match="parallel.tp=2 neither divides nor is a multiple of "
                                         "num_key_value_heads=3"):
        ParallelDims(tp=2, world_size=2).check_model(**{**LLAMA, "num_key_value_heads": 3})


def test_placement_keeps_tp_groups_on_one_node() -> None:
    dims = ParallelDims(tp=2, pp=2, world_size=4)
    assert mesh_order(["a", "a", "b", "b"], dims) == [0, 1, 2, 3]  # one stage per node
    # Ranks dealt round-robin over nodes (srun --distribution=cyclic): TP pairs stay on-node.
    assert mesh_order(["a", "b", "a", "b"], dims) == [0, 2, 1, 3]
    dims = ParallelDims(tp=2, pp=4, world_size=8)
    order = mesh_order(["n0"] * 4 + ["n1"] * 4, dims)
    assert order == list(range(8))  # stages 0-1 on n0, 2-3 on n1: one PP hop crosses nodes


def test_placement_rejects_tp_groups_that_would_span_nodes() -> None:
    with pytest.raises(ValueError, match=r"parallel.tp=4: node 'a' has 2 ranks, so a "
                                         r"tensor-parallel group would span nodes"):
        mesh_order(["a", "a", "b", "b"], ParallelDims(tp=4, world_size=4))


def test_replicas_of_their_own_layouts_are_cut_in_rank_order() -> None:
    # A tp=2 prefill replica and a one-rank decode replica on one node.
    assert place_replicas(["a"] * 3, [(2, 1), (1, 1)]) == [[0, 1], [2]]
    # Ranks dealt cyclically over two nodes: the TP pair is found on node a.
    assert place_replicas(["a", "b", "a", "b"], [(2, 1), (1, 1), (1, 1)]) == [[0, 2], [1], [3]]
    # Alike layouts cut mesh_order' order, as data-parallel replicas are.
    nodes = ["a", "b", "a", "b"]
    order = mesh_order(nodes, ParallelDims(tp=2, dp=2, world_size=4))
    assert sum(place_replicas(nodes, [(2, 1), (2, 1)]), []) == order
    assert place_replicas(["a"] * 4, [(1, 2), (2, 1)]) == [[0, 1], [2, 3]]


def test_a_replica_whose_tp_group_would_span_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"replica 1 \(tp=2, pp=1\): its tensor-parallel "
                                         r"group of ranks \[1, 2\] would span nodes"):
        place_replicas(["a", "a", "b"], [(1, 1), (2, 1)])
    with pytest.raises(ValueError, match="node_ids"):
        place_replicas(["a"] * 2, [(2, 1), (1, 1)])


def test_groups_on_a_single_gloo_rank() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        groups = ProcessGroups.build(ParallelDims(), rank=0, node_ids=["a"], device_type="cpu",
                                     op_timeout=timedelta(seconds=30))
        assert (groups.dp_rank, groups.pp_rank, groups.tp_rank) == (0, 0, 0)
        assert groups.mesh.mesh_dim_names == ("dp", "pp", "tp")
        assert groups.is_driver and groups.is_sampler
        assert groups.is_first_stage and groups.is_last_stage
        assert groups.tp.size == 1 and groups.pp_group is None and groups.result_group is None
        assert groups.describe() == "rank 0 (pp stage 0 of 1, tp rank 0 of 1)"
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
