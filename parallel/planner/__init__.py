"""The sharding planner: topology, cluster, scenario, cost model, search, prediction,
calibration and diagnosis."""
