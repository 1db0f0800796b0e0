"""Running caches over several processes with torch.distributed (NCCL between GPUs, gloo on
CPUs): ``kvcache.distributed.tp`` keeps tensor-parallel ranks' host planning in lockstep."""
