"""parallel=auto and disagg=auto at startup: the planner picks tp and pp (or a prefill/decode
split) for the ranks this run has."""

from __future__ import annotations

import dataclasses
import sys

from meshserve.engine.config.disagg_config import PhaseLayout
from meshserve.engine.config.runtime_config import RuntimeConfig
from meshserve.models.arch import ModelArch
from meshserve.parallel.comm.discovery import LaunchEnv
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.disagg_search import choose_kind
from meshserve.parallel.planner.search import options_for, plan_for, shape_for
from meshserve.parallel.planner.topology import detect_cluster


def run_cluster(config: RuntimeConfig, device: str) -> ClusterConfig:
    """The cluster parallel=auto plans on: the configured preset when it describes the
    devices this run uses, else (a GPU run with a CPU preset, such as the default
    local-cpu) this machine's GPUs as detected."""
    if device == config.cluster.device_type:
        return config.cluster
    detected = detect_cluster() if device == "cuda" else None
    if detected is None:
        raise ValueError(f"parallel=auto: cluster={config.cluster.name} describes "
                         f"{config.cluster.device_type} devices but this run's device is "
                         f"{device}; allowed: a {device} cluster preset (`meshserve calibrate` "
                         "writes one for this machine), or degrees set by hand "
                         "(parallel.tp=..., or parallel=single)")
    return detected


def launched_cluster(cluster: ClusterConfig, env: LaunchEnv) -> ClusterConfig:
    """The configured cluster reshaped to the ranks a launcher started: its nodes and
    ranks per node; the device figures stay the preset's."""
    if env.num_nodes * env.local_world_size != env.world_size:
        raise ValueError(f"parallel.auto=true with {env.describe()}: the planner needs the "
                         f"same number of ranks on every node; allowed is world size = nodes x "
                         f"ranks per node ({env.num_nodes} x {env.local_world_size})")
    return dataclasses.replace(cluster, num_nodes=env.num_nodes,
                               devices_per_node=env.local_world_size,
                               nvlink_domain_size=min(cluster.nvlink_domain_size,
                                                      env.local_world_size))


def resolve_layout(config: RuntimeConfig, arch: ModelArch, env: LaunchEnv | None,
                   device: str, *, announce: bool = True,
                   max_dp: int | None = 1) -> RuntimeConfig:
    """`config` with concrete degrees: unchanged unless parallel.auto, else the planner's
    (tp, pp, dp) with at most `max_dp` replicas (None: any), for exactly the launched ranks
    or, without a launcher, for up to the configured cluster's devices.

    Every rank computes the same answer (the planner is deterministic), so no rank has to
    wait for another's choice.
    """
    if config.disagg.mode == "auto":
        config = disagg_auto(config, arch, env, device, announce=announce, max_dp=max_dp)
    if config.disagg.enabled:
        return disagg_layout(config)
    if not config.parallel.auto:
        return config
    cluster = run_cluster(config, device)
    if env is not None:
        cluster = launched_cluster(cluster, env)
    # A launcher's ranks must all be used; started alone, the run takes as many of the
    # cluster's devices as pay for themselves (a small model stays on one).
    chosen = plan_for(dataclasses.replace(config, cluster=cluster), arch, max_dp=max_dp,
                      fill_cluster=env is not None)
    if announce and (env is None or env.rank == 0):
        print(f"meshserve: parallel=auto chose tp={chosen.tp}, pp={chosen.pp}, "
              f"dp={chosen.dp} for "
              f"{cluster.num_nodes} node(s) x {cluster.devices_per_node} "
              f"{cluster.device_type} rank(s): {chosen.explanation}", file=sys.stderr)
    parallel = dataclasses.replace(config.parallel, auto=False, tp=chosen.tp, pp=chosen.pp,
                                   dp=chosen.dp)
    # The reshaped cluster goes along, so the runtime's stage split is the planner's.
    return dataclasses.replace(config, cluster=cluster, parallel=parallel)


def disagg_layout(config: RuntimeConfig) -> RuntimeConfig:
    """disagg.mode=manual: disagg.prefill.replicas + disagg.decode.replicas replicas, as
    data parallelism of that many (each replica's own tp and pp come from its phase;
    parallel=auto plans nothing then; degrees given by hand must agree)."""
    par, n = config.parallel, config.disagg.num_replicas
    if not par.auto and (par.tp * par.pp != 1 or par.dp not in (1, n)):
        raise ValueError(f"disagg.mode=manual with parallel.tp={par.tp}, pp={par.pp}, "
                         f"dp={par.dp}: allowed is tp=pp=1 and dp=1 or {n} (the replicas "
                         "come from disagg.prefill.replicas and disagg.decode.replicas)")
    return dataclasses.replace(config, parallel=dataclasses.replace(
        par, auto=False, tp=1, pp=1, dp=n))


def disagg_auto(config: RuntimeConfig, arch: ModelArch, env: LaunchEnv | None, device: str,
                *, announce: bool = True, max_dp: int | None = 1) -> RuntimeConfig:
    """disagg=auto: the planner weighs colocated layouts against prefill/decode splits on
    the run's cluster (the launched ranks, all of them; else up to the cluster's devices)
    and `config` becomes the better one: disagg=manual with the split's phases, or
    disagg=none with the colocated degrees (parallel=auto's choice, at most `max_dp`
    replicas; degrees set by hand stay)."""
    cluster = run_cluster(config, device)
    if env is not None:
        cluster = launched_cluster(cluster, env)
    options = dataclasses.replace(options_for(config), fill_cluster=env is not None,
                                  max_dp=max_dp, simulate=config.disagg.simulate)
    choice = choose_kind(shape_for(config, arch, cluster.device_type), cluster, config.scenario, options)
    if announce and (env is None or env.rank == 0):
        print(f"meshserve: disagg=auto chose {choice.kind} serving for {cluster.num_nodes} "
              f"node(s) x {cluster.devices_per_node} {cluster.device_type} rank(s): "
              f"{choice.explanation}", file=sys.stderr)
    split = choice.split
    if choice.kind == "disaggregated" and split is not None:
        disagg = dataclasses.replace(
            config.disagg, mode="manual",
            prefill=PhaseLayout(replicas=split.prefill.replicas, tp=split.prefill.tp,
                                pp=split.prefill.pp),
            decode=PhaseLayout(replicas=split.decode.replicas, tp=split.decode.tp,
                               pp=split.decode.pp))
        return dataclasses.replace(config, cluster=cluster, disagg=disagg,
                                   parallel=dataclasses.replace(config.parallel, auto=False,
                                                                tp=1, pp=1, dp=1))
    colocated = dataclasses.replace(config, disagg=dataclasses.replace(config.disagg,
                                                                        mode="none"))
    return resolve_layout(colocated, arch, env, device, announce=announce, max_dp=max_dp)
