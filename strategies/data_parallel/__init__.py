"""Data parallel: every rank holds the whole model and averages its gradients with the others.

`NaiveDataParallel` is the parameter server (the plan ``naive``), `BucketedDataParallel` our DDP (``dp``):
bucketed all-reduce overlapped with backward. ZeRO (`strategies.zero`) shards the same axis further.
"""

from strategies.data_parallel.bucketed import DEFAULT_BUCKET_CAP_MB, BucketedDataParallel, plan_buckets
from strategies.data_parallel.naive import NaiveDataParallel
from strategies.data_parallel.sync import GradSync, broadcast_module

__all__ = ["DEFAULT_BUCKET_CAP_MB", "BucketedDataParallel", "GradSync", "NaiveDataParallel", "broadcast_module",
           "plan_buckets"]
