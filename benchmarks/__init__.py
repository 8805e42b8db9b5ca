"""weightstore's benchmarks: scripts, not tests. ``python -m benchmarks`` runs them all."""
