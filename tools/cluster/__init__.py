"""Clusters to run on from a checkout: the local Slurm cluster (`python -m
tools.cluster.slurm_local up`, docs/launching.md) and the GPU machine's wheels
(`bash tools/cluster/device_wheels.sh` here, `bash tools/cluster/device_setup.sh` there,
docs/testing.md)."""
