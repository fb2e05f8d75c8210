"""The draft side of Dovetail: feature-level draft heads (DGF, EAGLE fc) and EAGLE-2 dynamic
trees (``drafter``), served by ``server`` as the gpu_worker process.

The head reuses cpu_worker's Llama decoder layers (``cpu_worker.model.llama``): workers may import
each other's modules, never the runtime above them.
"""
