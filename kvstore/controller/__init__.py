"""The KVSP Placement Controller: instance status and lifecycle, sessions and
checkpoints, reshard plans (placement, prefetch and resume build on these)."""
