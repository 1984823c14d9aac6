"""Pipeline stages: which decoder layers each stage runs, balanced by cost.

Stage 0 also embeds the tokens and the last stage also runs the final norm and the LM
head, so an even split of the layers leaves the last stage slowest whenever the LM head
is large (Llama-3-8B: the head reads as many bytes as ~2.4 decoder layers). The planner
prices a layer, the embedding and the head with the cost model (planner.stage_ranges);
the runtime splits with the same costs, so it runs the ranges the planner predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.validation import require


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Cost of one decoder layer and of the extras of the first and last stage."""

    layer: float
    """One decoder layer."""
    embed: float = 0.0
    """Stage 0's token embedding (and the runtime's fixed work per forward)."""
    head: float = 0.0
    """The last stage's final norm and LM head (its part of a split head)."""
    head_first: float = 0.0
    """Stage 0's part of a split LM head."""

    def __post_init__(self) -> None:
        require(self.layer > 0, "costs.layer", self.layer, "a cost > 0")
        require(self.embed >= 0 and self.head >= 0 and self.head_first >= 0,
                "costs.embed/head/head_first", (self.embed, self.head, self.head_first),
                "costs >= 0")


def stage_layer_ranges(num_layers: int, num_stages: int,
                       costs: StageCosts | None = None) -> list[tuple[int, int]]:
    """[start, end) layer range per stage, every stage at least one layer, minimising the
    cost of the slowest stage; among equally good splits earlier stages take more layers."""
    require(num_stages >= 1, "parallel.pp", num_stages, "an int >= 1")
    require(num_layers >= num_stages, "parallel.pp", num_stages,
            f"at most num_hidden_layers={num_layers} (every stage needs a layer)")
    costs = costs or StageCosts(layer=1.0)

    def cost(stage: int, n: int) -> float:
        extra = (costs.embed + costs.head_first if stage == 0 else 0.0) + \
            (costs.head if stage == num_stages - 1 else 0.0)
        return extra + n * costs.layer

    # best[s][j]: the smallest max-cost of stages 0..s-1 running the first j layers.
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, num_layers - (num_stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], cost(s - 1, j - i)) for i in range(s - 1, j))
    # Walk back from the last stage, giving each stage the fewest layers that stay optimal,
    # which leaves the most to the stages before it.
    bound = best[num_stages][num_layers]
    ranges: list[tuple[int, int]] = []
    end = num_layers
    for s in range(num_stages, 0, -1):
        start = max(i for i in range(s - 1, end)
                    if max(best[s - 1][i], cost(s - 1, end - i)) <= bound)
        ranges.append((start, end))
        end = start
    assert end == 0, ranges
    return ranges[::-1]


def head_first_fraction(split_lm_head: bool, tp: int, pp: int, device_type: str) -> float:
    """Share of the LM head's vocabulary stage 0 holds: half when the head is split
    (parallel.split_lm_head, a CPU pipeline of TP size 1), else none. On GPUs the head stays
    on the last stage: its logits would travel back to stage 0 against the direction of the
    pipeline's NCCL communicator, which orders one pair's sends and receives on one stream
    (that needs a communicator of its own, not built yet)."""
    return 0.5 if split_lm_head and pp > 1 and tp == 1 and device_type == "cpu" else 0.0
