"""Data loading for distributed training: samplers that balance the ranks' load by sample complexity.

    from ort_trainer.data import LoadBalancingDistributedSampler, LoadBalancingDistributedBatchSampler
"""
from ._sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]
