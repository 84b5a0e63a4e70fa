"""Ray orchestration: controller, actors, training backends, weight sync, checkpoints."""
