"""Communication: the mesh and its groups, point-to-point, broadcast, shared memory,
rank discovery and spawning."""
