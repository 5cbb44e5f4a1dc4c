"""One process per pipeline stage plus a controller (rank 0), over torch.distributed (gloo; NCCL between GPUs)."""
