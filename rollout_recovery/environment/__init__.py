"""The rollout environment: episodes, token capture, lineage, checkpoints."""
