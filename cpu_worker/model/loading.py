"""Read a Llama-family checkpoint from a local Hugging Face folder, and place its tensors.

The one weight streamer both workers call: the target's decoder (``load_decoder``; the engine
side's ``cpu_worker.target_loading`` adds its precisions) and the draft heads
(``gpu_worker.checkpoint``) read their folders and place their tensors here.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn

from cpu_worker.kernels.huge_pages import empty_on_huge_pages, release_freed_memory
from cpu_worker.kernels.int8 import RowwiseInt8Linear
from cpu_worker.kernels.linear import is_linear
from cpu_worker.kernels.progress import progress_bar
from cpu_worker.model.embedding import NARROW_FLOATS, StoredEmbedding, table
from cpu_worker.model.hf_config import plain_config
from cpu_worker.model.llama import LlamaDecoder, LlamaSpec, ModelConfigError
from cpu_worker.model.model_dir import ModelLoadError, is_gguf, read_config, read_safetensors_header

_PREFIXES = ("model.",)


def _index(model_dir: Path) -> dict[str, Path] | None:
    """{tensor name: shard file} from a sharded checkpoint's index, or None when unsharded."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.exists():
            try:  # a cut or hand-edited index was a JSONDecodeError/KeyError traceback
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (ValueError, KeyError, TypeError) as error:
                raise ModelLoadError(f"{index} is not a shard index ({type(error).__name__}: {error})") from None
            missing = sorted({name for name in weight_map.values() if not (model_dir / name).exists()})
            if missing:
                raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
            return {tensor: model_dir / name for tensor, name in weight_map.items()}
    return None


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors (single or sharded) before pytorch .bin."""
    index = _index(model_dir)
    if index is not None:
        return sorted(set(index.values()))
    for pattern in ("model.safetensors", "model-*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin"):
        found = sorted(model_dir.glob(pattern))
        if found:
            return found
    present = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
    raise ModelLoadError(
        f"no weights in {model_dir}: expected model.safetensors, sharded safetensors with an index, "
        f"or pytorch_model*.bin; found {present or 'an empty folder'}"
    )


def _read_file(file: Path, names: set[str] | None) -> dict[str, torch.Tensor]:
    """The named tensors present in one file (all when ``names`` is None); safetensors reads
    only those, .bin files are memory-mapped so a large shard is not read whole."""
    if file.suffix == ".safetensors":
        return dict(_stream_safetensors(file, names))
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # a cut or foreign file: torch's UnpicklingError/EOFError was a traceback
        # (whose text suggests weights_only=False, which would run the file's code: not repeated here)
        raise ModelLoadError(f"{file} cannot be read as a PyTorch checkpoint of tensors ({type(error).__name__}): "
                             "truncated, corrupt, or pickling more than tensors") from None
    if not isinstance(state, dict):
        raise ModelLoadError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
    return {name: tensor for name, tensor in state.items() if names is None or name in names}


def read_tensors(model_dir: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The named tensors (all when ``names`` is None) of a checkpoint folder or GGUF file (fp32, under
    Hugging Face's names); names it lacks are absent from the result. With an index, only the shards
    holding them are opened."""
    wanted = None if names is None else set(names)
    if is_gguf(model_dir):
        from cpu_worker.model.gguf_loading import gguf_tensors

        return gguf_tensors(model_dir, wanted)
    found: dict[str, torch.Tensor] = {}
    for file in _files_for(model_dir, wanted):
        found.update(_read_file(file, wanted))
    return found


def load_spec(model_dir: Path) -> LlamaSpec:
    if is_gguf(model_dir):
        from cpu_worker.model.gguf_file import GGUFFile
        from cpu_worker.model.gguf_loading import gguf_spec

        with GGUFFile(model_dir) as file:
            return gguf_spec(file)
    raw = read_config(model_dir)  # a ModelLoadError for a file that is not a JSON object
    config = plain_config(raw) or _transformers_config(model_dir, raw)
    try:
        return _checked_dimensions(LlamaSpec.from_hf_config(config), model_dir)
    except ModelConfigError as error:
        raise ModelLoadError(f"{model_dir}: {error}") from None


def _transformers_config(model_dir: Path, raw: dict) -> object:
    """transformers' reading of a config that leaves something to its defaults or checks (seconds:
    importing transformers)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:
        # Whatever transformers' validation raises (StrictDataclass errors, a ZeroDivisionError for 0
        # heads) is this config's fault: one line, not a traceback.
        raise ModelLoadError(f"cannot parse {model_dir / 'config.json'} (model_type {raw.get('model_type')!r}): "
                             f"{str(error).strip().splitlines()[-1].strip()}") from None


def _checked_dimensions(spec: LlamaSpec, model_dir: Path) -> LlamaSpec:
    """A decoder can be built from ``spec``: a hand-edited config.json with a negative layer count
    or key/value heads that do not divide the heads got past transformers and failed deep in the load."""
    sizes = {"vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
             "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
             "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
             "head_dim": spec.head_dim, "max_position_embeddings": spec.max_position_embeddings}
    wrong = [f"{key} {value}" for key, value in sizes.items() if value < 1]
    if wrong:
        raise ModelLoadError(f"{model_dir / 'config.json'}: {', '.join(wrong)}; each must be a positive integer")
    if spec.num_heads % spec.num_kv_heads:
        raise ModelLoadError(f"{model_dir / 'config.json'}: num_attention_heads {spec.num_heads} is not a multiple "
                             f"of num_key_value_heads {spec.num_kv_heads}")
    return spec


# safetensors dtype codes (the format's header spells them so).
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _stream_safetensors(file: Path, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A safetensors file's tensors (only ``names`` when given; the rest are not read), each
    read into its own buffer. Not through safetensors' memory map: the pages of a mapped shard
    stay in this process's resident set until the file is closed, which added a whole 2 GB
    shard to the peak of a 7B int8 load."""
    with open(file, "rb") as handle:
        header, base = read_safetensors_header(handle)
        entries = sorted((info["data_offsets"][0], name, info) for name, info in header.items()
                         if name != "__metadata__" and (names is None or name in names))
        for start, name, info in entries:
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ModelLoadError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
            size = info["data_offsets"][1] - start
            # On huge pages where they are advised: a fresh 4 KB page faulted in for every 4 KB read
            # (and bytearray's zeroing) was a quarter of a 7B load.
            buffer = empty_on_huge_pages((size,), torch.uint8)
            handle.seek(base + start)
            if size and handle.readinto((ctypes.c_char * size).from_address(buffer.data_ptr())) != size:
                raise ModelLoadError(f"{file} is truncated (tensor {name})")
            yield name, buffer.view(dtype).reshape(info["shape"])


def _files_for(model_dir: Path, wanted: set[str] | None) -> list[Path]:
    """The weight files holding ``wanted`` (all files when None or unsharded)."""
    index = _index(model_dir)
    if index is not None and wanted is not None:
        return sorted({index[name] for name in wanted if name in index})
    return weight_files(model_dir)


def iter_tensors(model_dir: Path, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder (only ``names`` when given), one at a time: a 13 GB
    folder never sits in RAM."""
    for file in _files_for(model_dir, names):
        if file.suffix == ".safetensors":
            yield from _stream_safetensors(file, names)
        else:
            yield from _read_file(file, names).items()


def tensor_shapes(model_dir: Path, names: set[str] | None = None) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a checkpoint's tensors (only ``names`` when given) without reading their
    data: safetensors headers, memory-mapped .bin files, a GGUF's tensor table."""
    if is_gguf(model_dir):
        from cpu_worker.model.gguf_loading import gguf_tensors

        return gguf_tensors(model_dir, names, shapes_only=True)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _files_for(model_dir, names):
        if file.suffix == ".safetensors":
            with open(file, "rb") as handle:
                header, _ = read_safetensors_header(handle)
            shapes.update((name, tuple(info["shape"])) for name, info in header.items()
                          if name != "__metadata__" and (names is None or name in names))
        else:
            shapes.update((name, tuple(tensor.shape)) for name, tensor in _read_file(file, names).items())
    return shapes


# Builds a quantized linear layer from a weight as the checkpoint holds it, its bias (if it came first)
# and the layer's name in the model (a precision may keep some layers wider: the lm_head).
LinearMaker = Callable[[torch.Tensor, "torch.Tensor | None", str], nn.Module]


def _rowwise_int8(weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> nn.Module:
    return RowwiseInt8Linear(weight, bias)


def keeps_stored_tables(quantized: bool, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model keeps its embedding table as the checkpoint stores it (fp16/bf16 values, a GGUF
    file's blocks; rows widened on lookup): a quantized model with fp32 activations on the CPU, whose
    table serves lookups only."""
    return quantized and dtype == torch.float32 and torch.device(device).type == "cpu"


class WeightPlacer:
    """Puts checkpoint tensors into a model built on the meta device, converting each to its
    final dtype and device as it arrives: ``quantize`` makes every linear weight W8A8 int8 at
    once (True), or whatever layer a ``LinearMaker`` makes of it (block-quantized weights), so
    peak memory stays near the converted model plus one source tensor. ``trainable`` keeps each
    parameter's ``requires_grad`` (a head being trained); else all are frozen. A quantized model with
    fp32 activations on the CPU keeps an fp16/bf16 embedding table as it comes (``StoredEmbedding``:
    rows widened on lookup, exactly); with ``table_dtype`` any table is stored in that dtype (a bf16
    target's, like its other weights: one copy that a tied lm_head shares)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, quantize: bool | LinearMaker,
                 device: torch.device | str = "cpu", trainable: bool = False, table_dtype: torch.dtype | None = None):
        self.model = model
        self.dtype = dtype
        self.table_dtype = table_dtype
        self.make_linear: LinearMaker | None = _rowwise_int8 if quantize is True else (quantize or None)
        self.quantize = self.make_linear is not None
        self.device = torch.device(device)
        self.trainable = trainable
        self._waiting: dict[str, torch.Tensor] = {}  # a linear's weight whose bias has not come yet

    def place(self, name: str, tensor: torch.Tensor) -> None:
        module_name, _, attribute = name.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else self.model
        built = getattr(module, attribute, None)
        # A config that does not describe its weights (hidden_size left out, so transformers' default
        # 4096 stood in) loaded anyway: setattr takes any shape, and the spec then lied downstream.
        if isinstance(built, torch.Tensor) and isinstance(tensor, torch.Tensor) and built.shape != tensor.shape:
            raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, but the config implies "
                                 f"{tuple(built.shape)}: config.json does not describe these weights")
        if self.make_linear is not None and is_linear(module):
            self._place_quantized(module_name, module, attribute, tensor)
            return
        if self._keeps_table(module, attribute, tensor):
            stored = tensor if self.table_dtype is None else tensor.to(self.table_dtype)
            self._replace(module_name, StoredEmbedding(stored))
            return
        requires_grad = self.trainable and getattr(module, attribute).requires_grad
        setattr(module, attribute, nn.Parameter(tensor.to(device=self.device, dtype=self.dtype),
                                                requires_grad=requires_grad))

    @property
    def keeps_tables(self) -> bool:
        """Whether an embedding stays as its checkpoint stores it (``keeps_stored_tables``)."""
        return keeps_stored_tables(self.quantize, self.dtype, self.device)

    def _keeps_table(self, module: nn.Module, attribute: str, tensor: torch.Tensor) -> bool:
        return (self.keeps_tables and isinstance(module, nn.Embedding) and attribute == "weight"
                and (tensor.dtype in NARROW_FLOATS or self.table_dtype is not None))

    def place_table(self, module_name: str, embedding: nn.Module) -> None:
        """An embedding module made elsewhere in place of ``module_name`` (a GGUF file's table in its
        blocks: ``gguf_loading.gguf_stored_table``); only where ``keeps_tables``."""
        if not self.keeps_tables:
            raise ValueError("a stored embedding table is for a quantized model with fp32 activations on the CPU")
        self._replace(module_name, embedding)

    def _replace(self, module_name: str, replacement: nn.Module) -> None:
        parent_name, _, child = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, replacement)

    def _place_quantized(self, module_name: str, module: nn.Module, attribute: str, tensor: torch.Tensor) -> None:
        """A linear layer is built once its weight and bias (if it has one) have both come: the
        layers keep their bias where the kernels read it, so one set afterwards would be lost
        (a pytorch_model.bin stores a layer's weight before its bias)."""
        if attribute == "weight" and isinstance(module.bias, torch.Tensor) and module.bias.is_meta:
            self._waiting[module_name] = tensor  # its bias is still to come
            return
        if attribute == "weight":
            weight, bias = tensor, module.bias if isinstance(module.bias, torch.Tensor) else None
        else:  # a bias, before or after its weight
            module.bias = nn.Parameter(tensor.to(torch.float32), requires_grad=False)
            if module_name not in self._waiting:
                return
            weight, bias = self._waiting.pop(module_name), module.bias
        assert self.make_linear is not None
        self._replace(module_name, self.make_linear(weight, bias, module_name))

    def unplaced(self) -> list[str]:
        """Names of parameters still on the meta device (none once every tensor came)."""
        return sorted(name for name, parameter in self.model.named_parameters() if parameter.is_meta)


def load_decoder(model_dir: Path, dtype: torch.dtype, quantize: bool | LinearMaker = False,
                 spec: LlamaSpec | None = None, table_dtype: torch.dtype | None = None) -> LlamaDecoder:
    """The decoder in ``model_dir`` (its ``spec`` read there unless given), built tensor by
    tensor in ``dtype``, every linear quantized as ``quantize`` says and the embedding table
    kept in ``table_dtype`` (``WeightPlacer``); every weight must be present.
    Frozen, in eval mode, its projections separate (``fusion`` joins them). A GGUF file's comes in
    ``dtype`` (dequantized: the reference its blocks stand for) with ``quantize`` False."""
    if is_gguf(model_dir) and not quantize:
        from cpu_worker.model.gguf_loading import load_gguf_decoder

        return load_gguf_decoder(model_dir, dtype)
    spec = load_spec(model_dir) if spec is None else spec
    with torch.device("meta"):
        model = LlamaDecoder(spec)
    expected = set(model.state_dict().keys())
    placer = WeightPlacer(model, dtype, quantize, table_dtype=table_dtype)
    loaded: set[str] = set()
    with progress_bar(len(expected), f"{'load+quantize' if quantize else 'load'} {model_dir.name}", "tensor") as bar:
        for name, tensor in iter_tensors(model_dir):
            for prefix in _PREFIXES:
                name = name.removeprefix(prefix)
            if name in expected and name not in loaded:
                placer.place(name, tensor)
                loaded.add(name)
                bar.update()
            del tensor
            if len(loaded) % 16 == 0:
                release_freed_memory()
    if "lm_head.weight" not in loaded and spec.tie_word_embeddings and "embed_tokens.weight" in loaded:
        if quantize:
            placer.place("lm_head.weight", table(model.embed_tokens))
        else:
            model.lm_head.weight = cast(nn.Parameter, table(model.embed_tokens))
        loaded.add("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} weights: {shown}")
    return model.eval().requires_grad_(False)
