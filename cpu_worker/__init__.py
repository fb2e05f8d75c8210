"""The target side of Dovetail: a Llama-family decoder on the CPU that prefills, decodes and
verifies draft trees (``engine``), served by ``server`` as the cpu_worker process.

Nothing is imported here, so torch-free modules (``model_dir``) stay importable without torch.
"""
