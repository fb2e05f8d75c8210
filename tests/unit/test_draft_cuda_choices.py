"""The choices a CUDA draft makes, checked without a GPU: which attention kernels its steps may
use, and how many host threads its worker takes. (On an H200, tools/device_check.sh measured
why: cuDNN's attention cost ~50 ms per fp16 draft level against ~3 ms without it.)"""

from __future__ import annotations

import torch

from gpu_worker.drafter import attention_backends
from gpu_worker.server import draft_threads


def backend_flags() -> tuple[bool, bool, bool, bool]:
    cuda = torch.backends.cuda
    return cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), \
        cuda.math_sdp_enabled()


def test_a_cuda_draft_step_never_uses_cudnn_attention_and_restores_the_flags_after() -> None:
    before = backend_flags()
    with attention_backends(torch.device("cuda")):
        cudnn, flash, efficient, math = backend_flags()
        assert not cudnn
        assert flash and efficient and math
    assert backend_flags() == before


def test_a_cpu_draft_step_leaves_torch_to_choose() -> None:
    before = backend_flags()
    with attention_backends(torch.device("cpu")):
        assert backend_flags() == before


def test_a_cuda_draft_takes_one_host_thread_unless_told_otherwise() -> None:
    assert draft_threads(None, torch.device("cuda")) == 1
    assert draft_threads(None, torch.device("cuda", 1)) == 1
    assert draft_threads(3, torch.device("cuda")) == 3
    assert draft_threads(None, torch.device("cpu")) is None
    assert draft_threads(2, torch.device("cpu")) == 2
