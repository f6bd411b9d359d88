"""Running plait on more than one host: network settings, multi-host rendezvous errors, and the
launch files ``plait launch slurm|k8s`` writes (an sbatch script, a Kubeflow PyTorchJob).

Everything here drives PyTorch's own launcher (``torchrun`` / ``torch.distributed.launcher`` with
the c10d rendezvous); plait adds the settings users get wrong and errors that name the fix.
"""
