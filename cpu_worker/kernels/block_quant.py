"""Linear layers on block-quantized weights (llama.cpp's Q8_0, Q4_0, Q4_1), row-invariant.

Each weight row is held in blocks of 32 along the input, each with an fp16 scale (and, for Q4_1,
an fp16 minimum): a GGUF file's values and scales, regrouped by 16 outputs for the kernel
(``interleave``); each input row is quantized per block of 32 with its own scales, to 8 bits or to
16 (``planes`` 1 or 2: two int8 digits, see ``native/block_gemv.c``). A row's result never depends on the
other rows of its call, so trees verify bit-exactly against decoding, as at today's int8.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from cpu_worker.kernels.huge_pages import empty_on_huge_pages
from cpu_worker.kernels.linear import LinearKernel
from cpu_worker.native import library as native

BLOCK = 32
GROUP = 16  # outputs side by side in the kernel's layout (AMX's tile width)
TYPES = {"q8_0": native.BLOCK_Q8_0, "q4_0": native.BLOCK_Q4_0, "q4_1": native.BLOCK_Q4_1}
GROUP_BLOCK_BYTES = {"q8_0": GROUP * BLOCK, "q4_0": GROUP * BLOCK // 2, "q4_1": GROUP * BLOCK // 2}  # a (group, block)
ACTIVATION_PLANES = {8: 1, 16: 2}  # activation bits -> int8 planes per block


def block_kernels_available() -> bool:
    """Whether block-quantized layers can run here: they have no path but the native library's."""
    return native.load() is not None


def library() -> ctypes.CDLL:
    """The native library (block_gemv.c is one of its sources)."""
    handle = native.load()
    if handle is None:
        raise RuntimeError("block-quantized weights need the native kernel library, and it could not be built "
                           "(no C compiler, or the build failed: the log says which); install a C compiler, or run "
                           "without it: --target-dtype fp32, bf16 or int8-row, --draft-dtype fp32 or int8")
    return handle


def round_half_away(values: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``, which llama.cpp's reference quantizers call: halves away from zero
    (``torch.round`` takes them to even, so 40.5 became 40 where a GGUF writer stores 41)."""
    magnitude = values.abs()
    whole = torch.floor(magnitude)
    return torch.sign(values) * (whole + torch.floor(2 * (magnitude - whole)))


# Rows the torch path quantizes at a time (a multiple of GROUP, so chunks join as whole groups of outputs).
QUANTIZE_ROWS = 4096


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    rows, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"block-quantized weights need an input width that is a multiple of {BLOCK}, got {k}")
    return weight.float().reshape(rows, k // BLOCK, BLOCK)


# The source dtypes the library's block quantizer reads as they are (dovetail.h's dtype codes).
_SOURCE_DTYPES = {torch.float32: native.DTYPE_FP32, torch.float16: native.DTYPE_FP16,
                  torch.bfloat16: native.DTYPE_BF16}


def _native_quantize(weight: torch.Tensor, kind: str) -> BlockWeights | None:
    """The blocks of ``weight`` from the kernel library's quantizer (``dovetail_quantize_weight_layout``:
    the torch path's arithmetic, every bit, written straight into the kernel's layout; it reads fp16
    and bf16 rows as they are), or None for a source it does not read (another dtype or device: the
    torch path quantizes those). It holds one row in floats per thread, so a whole matrix goes at once."""
    if weight.dtype not in _SOURCE_DTYPES or weight.device.type != "cpu":
        return None
    rows, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"block-quantized weights need an input width that is a multiple of {BLOCK}, got {k}")
    source = weight.contiguous()
    groups = (rows + GROUP - 1) // GROUP
    data = empty_on_huge_pages((groups, k // BLOCK * GROUP_BLOCK_BYTES[kind]), torch.uint8)
    if rows % GROUP:
        data[-1].zero_()  # the last group's missing outputs: zero weights (their scales are padded with zeros)
    scales = torch.empty(rows, k // BLOCK, dtype=torch.float32)
    minimums = torch.empty(rows, k // BLOCK, dtype=torch.float32)
    status = library().dovetail_quantize_weight_layout(source.data_ptr(), _SOURCE_DTYPES[weight.dtype], TYPES[kind],
                                                     data.data_ptr(), scales.data_ptr(), minimums.data_ptr(),
                                                     rows, k, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"quantizing a {rows}x{k} weight: no memory for a row buffer")
    return BlockWeights(kind, data, group_outputs(scales.half()),
                        group_outputs(minimums.half()) if kind == "q4_1" else None, k, rows)


def group_outputs(values: torch.Tensor) -> torch.Tensor:
    """[n_out, blocks] -> [ceil(n_out / 16), blocks, 16], padded with zeros: the kernel reads the 16
    lanes' scales of a block in one load."""
    rows, blocks = values.shape
    padded = torch.zeros((rows + GROUP - 1) // GROUP * GROUP, blocks, dtype=values.dtype)
    padded[:rows] = values
    return padded.reshape(-1, GROUP, blocks).transpose(1, 2).contiguous()


def ungroup(grouped: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of ``group_outputs``."""
    return grouped.transpose(1, 2).reshape(-1, grouped.shape[1])[:rows]


def gguf_bytes(kind: str, values: torch.Tensor) -> torch.Tensor:
    """The stored integers [rows, k] as GGUF's block bytes [rows, bytes per row] (scales apart): Q8_0 one
    byte a value; 4-bit values element j of a block in the low nibble, j + 16 in the high one."""
    if kind == "q8_0":
        return values.to(torch.int8).view(torch.uint8)
    blocks = values.reshape(values.shape[0], -1, BLOCK).to(torch.uint8)
    low, high = blocks[..., :BLOCK // 2], blocks[..., BLOCK // 2:]
    return (low | (high << 4)).reshape(values.shape[0], -1)


def interleave(kind: str, values: torch.Tensor) -> torch.Tensor:
    """The stored integers [rows, k] -> the kernel's layout [groups, bytes per group] (block_gemv.c), on
    huge pages: per (group of 16 outputs, block), chunk c of 4 inputs of the 16 outputs side by side;
    4-bit values two chunks a byte (c low, c + 4 high). Rows are padded to a multiple of 16 with zeros."""
    return interleave_bytes(kind, gguf_bytes(kind, values), values.shape[0], values.shape[1])


def interleave_bytes(kind: str, data: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """``interleave`` straight from GGUF's bytes (scales apart: [rows, bytes per row], or a strided
    [rows, blocks, bytes per block] view of a file's blocks) into huge pages, moving each byte once:
    byte j of a 4-bit GGUF block holds inputs j (low nibble) and j + 16 (high), the very pair the
    kernel's chunk v byte i holds (4v + i and 4(v + 4) + i); a Q8_0 byte is one input."""
    groups, blocks = (rows + GROUP - 1) // GROUP, k // BLOCK
    chunk_bytes = 8 if kind == "q8_0" else 4  # a block's chunks of 4 inputs: 8, or 4 in nibble pairs
    out = empty_on_huge_pages((groups, blocks * chunk_bytes * GROUP * 4), torch.uint8)
    laid = out.view(groups, blocks, chunk_bytes, GROUP, 4)
    source = data.view(torch.uint8).reshape(rows, blocks, chunk_bytes, 4)  # a view where the strides allow
    whole = rows // GROUP
    laid[:whole].copy_(source[:whole * GROUP].reshape(whole, GROUP, blocks, chunk_bytes, 4).permute(0, 2, 3, 1, 4))
    if rows % GROUP:  # the last group's missing outputs are zero bytes (zero weights, zero scales)
        tail = source.new_zeros(GROUP, blocks, chunk_bytes, 4)
        tail[:rows - whole * GROUP] = source[whole * GROUP:]
        laid[whole].copy_(tail.permute(1, 2, 0, 3))
    return out


def deinterleave(kind: str, data: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """The inverse of ``interleave``: the stored integers [rows, k]."""
    groups = data.shape[0]
    if kind == "q8_0":
        chunks = data.view(torch.int8).reshape(groups, k // BLOCK, 8, GROUP, 4).to(torch.int16)
    else:
        paired = data.reshape(groups, k // BLOCK, 4, GROUP, 4).to(torch.int16)
        chunks = torch.cat([paired & 0x0F, paired >> 4], dim=2)
    return chunks.permute(0, 3, 1, 2, 4).reshape(groups * GROUP, k)[:rows]


@dataclass
class BlockWeights:
    """One weight matrix as blocks: ``data`` in the kernel's layout (``interleave``: groups of 16
    outputs, one stream each), ``scales`` and ``minimums`` (Q4_1 only) fp16, grouped by 16 outputs
    (``group_outputs``). Built from GGUF's blocks (``from_blocks``) or from float weights (``quantize``)."""

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor | None
    in_features: int
    out_features: int

    @property
    def nbytes(self) -> int:
        extra = 0 if self.minimums is None else self.minimums.numel() * 2
        return self.data.numel() + self.scales.numel() * 2 + extra  # the padding of a last group of 16 included

    @classmethod
    def from_blocks(cls, kind: str, data: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                    in_features: int) -> BlockWeights:
        """From GGUF-ordered tensors: data [n_out, bytes per row], scales and minimums [n_out, k / 32] fp16.
        The bytes are only moved (``interleave_bytes``), never unpacked: a 7B file's 3.6 GB of blocks."""
        rows = scales.shape[0]
        return cls(kind, interleave_bytes(kind, data, rows, in_features), group_outputs(scales.half()),
                   None if minimums is None else group_outputs(minimums.half()), in_features, rows)

    @classmethod
    def from_values(cls, kind: str, values: torch.Tensor, scales: torch.Tensor,
                    minimums: torch.Tensor | None) -> BlockWeights:
        """From the stored integers [n_out, k] and their scales (and minimums) [n_out, k / 32]."""
        # On huge pages: a decode streams every byte once, and 4 KB pages cost a TLB miss every 4 KB
        # (q8_0 at 4096x4096, 2 threads: 0.72 ms on huge pages against 0.82 on 4 KB ones).
        return cls(kind, interleave(kind, values), group_outputs(scales.half()),
                   None if minimums is None else group_outputs(minimums.half()), values.shape[1], values.shape[0])

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str) -> BlockWeights:
        """llama.cpp's reference quantizers (``quantize_row_*_ref``), from float weights: in C, the whole
        matrix into its final buffer; in torch (sources the library does not read), QUANTIZE_ROWS rows
        at a time (the float temporaries of a whole 49k x 4096 lm_head took 5.5 GB of peak RSS). Rows
        are quantized on their own, so the chunks join (whole groups of outputs) bit for bit."""
        if kind not in TYPES:
            raise ValueError(f"unknown block type {kind!r}; known: {', '.join(TYPES)}")
        native_blocks = _native_quantize(weight.detach(), kind)
        if native_blocks is not None:
            return native_blocks
        rows = weight.shape[0]
        if rows <= QUANTIZE_ROWS:
            return cls._torch_quantize_rows(weight, kind)
        return cls.concatenate([cls._torch_quantize_rows(weight[start:start + QUANTIZE_ROWS], kind)
                                for start in range(0, rows, QUANTIZE_ROWS)])

    @classmethod
    def _torch_quantize_rows(cls, weight: torch.Tensor, kind: str) -> BlockWeights:
        """The same blocks in torch's ops: the reference the library's quantizer is held to, and the
        path for sources it does not read."""
        blocks = _blocks(weight.detach())
        rows, k = weight.shape
        if kind == "q8_0":
            d = blocks.abs().amax(-1, keepdim=True) / 127
            q = round_half_away(blocks * torch.where(d > 0, 1 / d, 0))
            return cls.from_values(kind, q.to(torch.int16).reshape(rows, k), d.squeeze(-1), None)
        if kind == "q4_0":
            d = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -8
            q = torch.clamp(torch.trunc(blocks * torch.where(d != 0, 1 / d, 0) + 8.5), max=15)
            return cls.from_values(kind, q.to(torch.int16).reshape(rows, k), d.squeeze(-1), None)
        if kind == "q4_1":
            low = blocks.amin(-1, keepdim=True)
            d = (blocks.amax(-1, keepdim=True) - low) / 15
            q = torch.clamp(torch.trunc((blocks - low) * torch.where(d > 0, 1 / d, 0) + 0.5), max=15)
            return cls.from_values(kind, q.to(torch.int16).reshape(rows, k), d.squeeze(-1), low.squeeze(-1))
        raise ValueError(f"unknown block type {kind!r}; known: {', '.join(TYPES)}")

    def values(self) -> torch.Tensor:
        """The stored integers [n_out, k] (int8 values, or 4-bit q as 0..15)."""
        return deinterleave(self.kind, self.data, self.out_features, self.in_features)

    def gguf_blocks(self) -> torch.Tensor:
        """The weights as GGUF orders them: [n_out, bytes per row] (the scales: ``ungroup``)."""
        return gguf_bytes(self.kind, self.values())

    @classmethod
    def concatenate(cls, parts: list[BlockWeights]) -> BlockWeights:
        """The parts' outputs side by side: rows and their scales joined, every value kept."""
        if len({(part.kind, part.in_features) for part in parts}) != 1:
            raise ValueError("only block weights of one type and input width can be concatenated")
        if all(part.out_features % GROUP == 0 for part in parts[:-1]):
            # Whole groups of 16 outputs (every real q/k/v and gate/up): each part's streams and grouped
            # scales join as they lie, the bytes from_values would lay out from the joined values.
            data = empty_on_huge_pages((sum(part.data.shape[0] for part in parts), parts[0].data.shape[1]), torch.uint8)
            return cls(parts[0].kind, torch.cat([part.data for part in parts], out=data),
                       torch.cat([part.scales for part in parts]),
                       None if parts[0].minimums is None else torch.cat([part.minimums for part in parts
                                                                        if part.minimums is not None]),
                       parts[0].in_features, sum(part.out_features for part in parts))
        minimums = None
        if parts[0].minimums is not None:
            minimums = torch.cat([ungroup(part.minimums, part.out_features) for part in parts
                                  if part.minimums is not None])
        return cls.from_values(parts[0].kind, torch.cat([part.values() for part in parts]),
                               torch.cat([ungroup(part.scales, part.out_features) for part in parts]), minimums)

    def dequantize(self) -> torch.Tensor:
        """The float weights these blocks stand for (tests, references)."""
        rows, k = self.out_features, self.in_features
        values = self.values().float().reshape(rows, k // BLOCK, BLOCK)
        if self.kind == "q4_0":
            values = values - 8
        out = values * ungroup(self.scales, rows).float().unsqueeze(-1)
        if self.minimums is not None:
            out = out + ungroup(self.minimums, rows).float().unsqueeze(-1)
        return out.reshape(rows, k)


def quantize_activations(rows: torch.Tensor, planes: int,
                         threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [count, k] float32 -> (planes of int8 [count, planes, k], scales [count, k / 32],
    block sums int32 [count, k / 32]): each row quantized per block of 32 from that row alone."""
    count, k = rows.shape
    xq = torch.empty(count, planes, k, dtype=torch.int8)
    xd = torch.empty(count, k // BLOCK)
    xs = torch.empty(count, k // BLOCK, dtype=torch.int32)
    library().dovetail_quantize_blocks(rows.data_ptr(), xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), count, k, planes,
                                       threads or torch.get_num_threads())
    return xq, xd, xs


def block_linear(x: torch.Tensor, weights: BlockWeights, bias: torch.Tensor | None = None,
                 threads: int | None = None, planes: int = 1) -> torch.Tensor:
    """x [..., k] float32 -> [..., n_out]: each row's input quantized per block (8 bits for ``planes``
    1, 16 for 2), then the block dot products."""
    if planes not in ACTIVATION_PLANES.values():
        raise ValueError(f"activations are quantized to one or two planes of int8, not {planes}")
    k, n_out = weights.in_features, weights.out_features
    rows = x.reshape(-1, k).float().contiguous()
    xq, xd, xs = quantize_activations(rows, planes, threads)
    out = torch.empty(rows.shape[0], n_out)
    minimums = None if weights.minimums is None else weights.minimums.data_ptr()
    status = library().dovetail_block_linear(
        xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), rows.shape[0], planes, weights.data.data_ptr(),
        weights.scales.data_ptr(), minimums, TYPES[weights.kind], None if bias is None else bias.data_ptr(),
        out.data_ptr(), n_out, k, threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the block kernel refused a {weights.kind} weight of {n_out}x{k}")
    return out.reshape(*x.shape[:-1], n_out)


def quantize_block_linears(model: nn.Module, kind: str, head_kind: str | None = None,
                           activation_bits: int = 8) -> nn.Module:
    """Swap every nn.Linear under ``model`` (in place) for a BlockQuantLinear of ``kind`` (the
    model's ``lm_head`` of ``head_kind`` when given), its activations at ``activation_bits``."""
    make = BlockQuantLinear.maker(kind, head_kind, activation_bits)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child.weight, child.bias, name))
        else:
            quantize_block_linears(child, kind, activation_bits=activation_bits)
    return model


def kernel_name() -> str:
    """The block kernel's path on this CPU, as the startup log names it (amx: tiles from a few rows
    up, VNNI below)."""
    handle = library()
    if handle.dovetail_block_amx_ready():
        return "dovetail-blocks-amx"
    return {2: "dovetail-blocks-vnni", 1: "dovetail-blocks-avx2"}.get(handle.dovetail_block_simd(),
                                                                      "dovetail-blocks-portable")


class BlockQuantLinear(LinearKernel):
    """``y = x W^T + b`` with W in blocks (Q8_0, Q4_0, Q4_1) and x quantized per block of 32 to
    ``activation_bits`` (8 or 16)."""

    row_invariant = True  # a row's bits never depend on the rest of its call

    def __init__(self, weights: BlockWeights, bias: torch.Tensor | None = None, activation_bits: int = 8):
        super().__init__()
        if activation_bits not in ACTIVATION_PLANES:
            raise ValueError(f"block activations are 8 or 16 bits, not {activation_bits}")
        self.weights = weights
        self.activation_bits = activation_bits
        self.in_features, self.out_features = weights.in_features, weights.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str, activation_bits: int = 8) -> BlockQuantLinear:
        return cls(BlockWeights.quantize(linear.weight, kind), linear.bias, activation_bits)

    @classmethod
    def maker(cls, kind: str, head_kind: str | None = None, activation_bits: int = 8
              ) -> Callable[[torch.Tensor, torch.Tensor | None, str], BlockQuantLinear]:
        """Builds a layer of ``kind`` (the ``lm_head`` of ``head_kind`` when given) from a checkpoint's
        weight as it streams in (``WeightPlacer``)."""
        def make(weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> BlockQuantLinear:
            chosen = head_kind if name == "lm_head" and head_kind else kind
            return cls(BlockWeights.quantize(weight, chosen), bias, activation_bits)
        return make

    @classmethod
    def concatenate(cls, layers: list[BlockQuantLinear]) -> BlockQuantLinear:
        """One layer whose outputs are ``layers``' side by side, bit for bit (rows are independent)."""
        if len({layer.activation_bits for layer in layers}) != 1:
            raise ValueError("only block layers with one activation width can be concatenated")
        biases = [layer.bias for layer in layers]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(layer.out_features) for b, layer in zip(biases, layers)])
        return cls(BlockWeights.concatenate([layer.weights for layer in layers]), bias, layers[0].activation_bits)

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weights.kind} x a{self.activation_bits}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = block_linear(x, self.weights, self.bias, planes=ACTIVATION_PLANES[self.activation_bits])
        return out.to(x.dtype)
