"""`shardfit train`: a Plan becomes a running job on DDP, FSDP, FSDP2 or DeepSpeed (see loop.train)."""
